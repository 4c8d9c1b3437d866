"""Adapter cold start, stage by stage: ``python -m executor_service.bench_load``.

Writes a synthetic base checkpoint with Qwen3-30B-A3B's MoE layer shape (H 2048, I 768,
E 128) and a PEFT 3D bf16 adapter for it of Qwen3-30B-A3B's size: 48 layers at rank 16 is
1.26 GB; by default 2 layers at rank 384 hold the same bytes (the base checkpoint stays small
enough for a CPU machine). Starts ``moelora-registry`` in its own process (local directory
backend, then S3 on moto's server) and an executor in this process, uploads the adapter and
times, for one new adapter each:

* ``upload``: ``RegistryClient.upload`` (what ``adapterctl upload`` does),
* ``cold``: ``LoadAdapter(to_gpu)`` of a version the executor has never seen: download with
  streaming sha256 into the disk cache → pack from the memory map into the compute dtype
  (pinned on CUDA) → host cache → slot copy,
* ``disk warm``: the same after UnloadAdapter (the disk cache keeps the files; the OS page
  cache too: this is not a cold-disk read),
* ``host warm``: after evicting the slot only (one host→device copy per layer tensor),
* stages alone: ``download`` (RegistryClient.download), ``pack`` (``pack_adapter`` of the
  disk-cache file),

and the p50 of Forward for another, pinned adapter while nothing loads and while the cold
load runs. Rates are adapter file bytes per second (1 GB = 10^9 bytes). The client is in the
executor's process (GIL shared), so the Forward figures are pessimistic. ``--small`` is a
seconds-long smoke run (tests use it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from executor_service.adapters import Location
from executor_service.app import ExecutorApp
from executor_service.client import ExecutorClient
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.packer import pack_adapter
from executor_service.runtime import ExecutorRuntime
from executor_service.synthetic import SyntheticBase, write_base_checkpoint
from shared.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from shared.bench_servers import moto_server, registry_server, write_adapter
from shared.model_spec import ModelSpec
from shared.refs import AdapterRef
from shared.registry_client import RegistryClient

BASE_NAME = "bench-base"
_GB = 1e9


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    layers: int
    rank: int


FULL = Shape(2048, 768, 128, 8, layers=2, rank=384)
SMALL = Shape(64, 32, 8, 2, layers=2, rank=16)


@dataclass
class Results:
    nbytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    forward_idle: list[float] = field(default_factory=list)
    forward_loading: list[float] = field(default_factory=list)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Forwards:
    """Forward calls for the pinned adapter, in a loop, until stopped."""

    def __init__(self, client: ExecutorClient, spec: ModelSpec, tokens: int) -> None:
        self.client = client
        self.layer = spec.moe_layers[0]
        self.hidden = torch.randn(tokens, spec.hidden_size, dtype=torch.bfloat16)
        self.tokens = tokens

    def once(self) -> float:
        return _timed(
            lambda: self.client.forward(self.layer, self.hidden, [(self.tokens, "other:1")])
        )

    def sample(self, count: int) -> list[float]:
        return [self.once() for _ in range(count)]

    def during(self, work: Callable[[], object]) -> tuple[float, list[float]]:
        """Seconds ``work`` takes in a thread, and the Forward times meanwhile."""
        seconds: list[float] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                seconds.append(_timed(work))
            except BaseException as exc:  # reported below, in the caller's thread
                error.append(exc)

        thread = threading.Thread(target=run)
        samples: list[float] = []
        thread.start()
        while thread.is_alive():
            samples.append(self.once())
        thread.join()
        if error:
            raise error[0]
        return seconds[0], samples


@contextmanager
def _executor(
    root: Path, address: str, args: argparse.Namespace, shape: Shape
) -> Iterator[tuple[ExecutorClient, ExecutorRuntime]]:
    settings = ExecutorSettings.model_validate(
        {
            "listen": "127.0.0.1:0",
            "base_model_path": root / "base",
            "base_model_name": BASE_NAME,
            "registry_address": address,
            "disk_cache_dir": root / f"disk-{address.rsplit(':', 1)[1]}",
            "device": args.device,
            "dtype": "bfloat16",
            "num_slots": 2,
            "max_rank": shape.rank,
            "host_cache_bytes": 8 * 1024**3,
            "kernel_autotune_seconds": 0.0,  # heuristic kernel configs: start at once
            "metrics_listen": "",
            "drain_seconds": 1.0,
            "log_level": "warning",
        }
    )
    app = ExecutorApp(settings, ExecutorMetrics(CollectorRegistry()))
    app.start()
    try:
        with ExecutorClient(app.address, timeout=3600) as client:
            client.wait_until_serving(timeout=3600)
            assert app.runtime is not None
            yield client, app.runtime
    finally:
        app.drain()


def _upload(address: str, root: Path, spec: ModelSpec, name: str) -> tuple[str, float]:
    with RegistryClient(address, timeout=3600) as registry:
        seconds = _timed(lambda: registry.upload(root / name, name, BASE_NAME, timeout=3600))
    return f"{name}:1", seconds


def _measure_local(root: Path, args: argparse.Namespace, shape: Shape, spec: ModelSpec) -> Results:
    results = Results(nbytes=(root / "cold").stat().st_size)
    workdir = root / "registry-local"
    workdir.mkdir()
    with registry_server(workdir, ["--max-rank", str(shape.rank)]) as address:
        with RegistryClient(address, timeout=600) as registry:
            registry.register_base_model(spec.to_proto(BASE_NAME))
        _upload(address, root, spec, "other")
        cold, results.seconds["upload"] = _upload(address, root, spec, "cold")
        with _executor(root, address, args, shape) as (client, runtime):
            device = torch.device(args.device)

            def load() -> None:
                client.load_adapter(cold, to_gpu=True)
                if device.type == "cuda":  # LoadAdapter returns once the copy is issued
                    torch.cuda.synchronize(device)

            if args.forwards:
                client.pin_adapter("other:1")
                forwards = _Forwards(client, spec, args.tokens)
                forwards.sample(3)
                results.forward_idle = forwards.sample(args.forwards)
                results.seconds["cold"], results.forward_loading = forwards.during(load)
            else:
                results.seconds["cold"] = _timed(load)
            client.unload_adapter(cold)
            results.seconds["disk warm"] = _timed(load)
            freed = runtime.adapters.free_slot(AdapterRef.parse(cold), timeout=60)
            assert freed.location is Location.HOST, freed.location
            digest = freed.adapter.digest
            results.seconds["host warm"] = _timed(load)
            disk = root / f"disk-{address.rsplit(':', 1)[1]}" / digest.removeprefix("sha256:")
            files = disk / WEIGHTS_FILE
            config = json.loads((disk / CONFIG_FILE).read_text())
            pin = device.type == "cuda"
            results.seconds["pack"] = _timed(
                lambda: pack_adapter(config, files, spec, shape.rank, torch.bfloat16, pin=pin)
            )
        with RegistryClient(address, timeout=3600) as registry:
            results.seconds["download"] = _timed(
                lambda: registry.download(cold, root / "download", timeout=3600)
            )
    return results


def _measure_s3(root: Path, args: argparse.Namespace, shape: Shape, spec: ModelSpec) -> float:
    workdir = root / "registry-s3"
    workdir.mkdir()
    with moto_server(workdir) as endpoint:
        flags = [
            "--max-rank",
            str(shape.rank),
            "--blob-url",
            "s3://bench-adapters/registry",
            "--s3-endpoint-url",
            endpoint,
            "--s3-region",
            "us-east-1",
            "--s3-path-style",
        ]
        with registry_server(workdir, flags) as address:
            with RegistryClient(address, timeout=600) as registry:
                registry.register_base_model(spec.to_proto(BASE_NAME))
            cold, _ = _upload(address, root, spec, "cold")
            with _executor(root, address, args, shape) as (client, _runtime):
                return _timed(lambda: client.load_adapter(cold, to_gpu=True))


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / _GB / seconds:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--small", action="store_true", help="a tiny shape: a smoke run")
    parser.add_argument("--layers", type=int, help="MoE layers (default 2)")
    parser.add_argument("--rank", type=int, help="adapter rank (default 384: 1.26 GB)")
    parser.add_argument("--tokens", type=int, default=16, help="T of the Forward calls")
    parser.add_argument(
        "--forwards",
        type=int,
        default=20,
        help="Forward calls for the idle p50; 0: no Forward at all",
    )
    parser.add_argument("--backends", default="local,s3", help="comma list: local, s3")
    args = parser.parse_args(argv)
    shape = SMALL if args.small else FULL
    shape = Shape(
        shape.hidden_size,
        shape.moe_intermediate_size,
        shape.num_experts,
        shape.top_k,
        layers=args.layers or shape.layers,
        rank=args.rank or shape.rank,
    )
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        root = Path(tmp)
        base = SyntheticBase(
            "qwen3_moe",
            hidden_size=shape.hidden_size,
            moe_intermediate_size=shape.moe_intermediate_size,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            num_layers=shape.layers,
        )
        spec = write_base_checkpoint(root / "base", base, dtype=torch.bfloat16)
        write_adapter(root / "other", spec, 16, seed=1)
        nbytes = write_adapter(root / "cold", spec, shape.rank, seed=2)
        results = _measure_local(root, args, shape, spec) if "local" in backends else Results()
        results.nbytes = nbytes
        if "s3" in backends:
            results.seconds["cold (S3)"] = _measure_s3(root, args, shape, spec)
    _print(results, args, shape)


def _print(results: Results, args: argparse.Namespace, shape: Shape) -> None:
    device = torch.device(args.device)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()}, {os.cpu_count()} cores"
    )
    print(
        f"\nadapter cold start: {results.nbytes / _GB:.3f} GB adapter ({shape.layers} MoE "
        f"layers, rank {shape.rank}, E {shape.num_experts}, H {shape.hidden_size}, "
        f"I {shape.moe_intermediate_size}, bf16), device {args.device} ({where}), "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}\n"
    )
    print("| step | seconds | GB/s |")
    print("|---|---:|---:|")
    for step, seconds in results.seconds.items():
        print(f"| {step} | {seconds:.3f} | {_rate(results.nbytes, seconds)} |")
    if results.forward_idle and results.forward_loading:
        idle = statistics.median(results.forward_idle) * 1e3
        loading = statistics.median(results.forward_loading) * 1e3
        print(
            f"\nForward p50 of another adapter (T={args.tokens}): {idle:.2f} ms idle, "
            f"{loading:.2f} ms while the cold load runs ({len(results.forward_loading)} calls, "
            f"{(loading / idle - 1) * 100:+.0f}%)"
        )


if __name__ == "__main__":
    main()
