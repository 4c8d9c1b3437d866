"""Adapter cold start, stage by stage: ``python -m executor_service.bench.load``.

Writes a synthetic base checkpoint with Qwen3-30B-A3B's MoE layer shape (H 2048, I 768,
E 128) and a PEFT 3D bf16 adapter for it of Qwen3-30B-A3B's size: 48 layers at rank 16 is
1.26 GB; by default 2 layers at rank 384 hold the same bytes (the base checkpoint stays small
enough for a CPU machine). Starts ``moelora-registry`` in its own process (local directory
backend, then S3 on moto's server) and an executor in this process, uploads the adapter and
times, on an otherwise idle executor:

* ``upload``: ``RegistryClient.upload`` (what ``adapterctl upload`` does),
* ``cold``: ``LoadAdapter(to_gpu)`` of a version the executor has never seen: parallel ranged
  reads into the disk cache, hashed as they arrive → each layer packed from the memory map as
  soon as its bytes are in (compute dtype; on CUDA packed on the GPU and copied back into
  pinned memory) → checked → host cache → slot copy,
* ``disk warm``: the same after UnloadAdapter (the disk cache keeps the files; the OS page
  cache too: this is not a cold-disk read),
* ``host warm``: after evicting the slot only (one host→device copy per layer tensor),
* stages alone: ``download`` (the executor's ranged download into an empty disk cache, until
  checked), ``pack`` (``pack_adapter`` of the disk-cache file on a loader thread, on the
  executor's device; with ``--device cuda`` also ``pack on the CPU``, as a CPU executor packs),

then Forward for another, pinned adapter from a client process of its own
(``bench.clients``) calling in a loop through one session: while ``--cold-loads`` new versions
load cold one after the other, then while the first of them loads again disk-warm
``--warm-loads`` times (unloaded between, outside the measured windows; the calls of each
kind's loads pooled), and alone in a quiet stretch just before each load (``--idle-seconds``
in all); p50 and p90 of the calls overlapping each kind of load, against those alone. Rates
are adapter file bytes per second (1 GB = 10^9 bytes). ``--small`` is a seconds-long smoke run
(tests use it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from executor_service.adapters import Location
from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.disk_cache import DiskCache
from executor_service.loader import Loader, load_threads
from executor_service.metrics import ExecutorMetrics
from executor_service.packer import pack_adapter
from executor_service.page_cache_dma import registration_declined
from executor_service.process import configure_process
from executor_service.registry_source import RegistrySource
from executor_service.runtime import ExecutorRuntime, download_streams
from executor_service.synthetic import SyntheticBase, write_base_checkpoint
from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from moelora.client.executor import ExecutorClient
from moelora.client.model_spec import ModelSpec
from moelora.client.registry import RegistryClient
from shared.bench_servers import moto_server, registry_server, write_adapter
from shared.refs import AdapterRef

BASE_NAME = "bench-base"
OTHER = "other:1"
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
    #: Forward latencies: idle, during a cold load, during a disk-warm load.
    forward: dict[str, list[float]] = field(default_factory=dict)
    #: Seconds of each load that ran while Forward was measured, by kind.
    loads: dict[str, list[float]] = field(default_factory=dict)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _ForwardClient:
    """A ``bench.clients`` process calling Forward for the pinned adapter: ``iters`` calls, or
    (0) until ``stop``."""

    def __init__(self, address: str, spec: ModelSpec, tokens: int, iters: int) -> None:
        command = [
            sys.executable,
            "-m",
            "executor_service.bench.clients",
            f"--address={address}",
            f"--layer={spec.moe_layers[0]}",
            f"--tokens={tokens}",
            f"--hidden={spec.hidden_size}",
            f"--adapters={OTHER}",
            f"--iters={iters}",
            "--warmup=2",
        ]
        self._proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        if not select.select([self._proc.stdout], [], [], 600)[0]:
            self._proc.kill()
            raise RuntimeError("the Forward client did not finish its warm-up in 600 s")
        if (line := self._proc.stdout.readline().strip()) != "ready":
            self._proc.kill()
            raise RuntimeError(f"the Forward client failed to start (said {line!r})")

    def go(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()

    def finish(self) -> list[tuple[float, float]]:
        """Stops the calls; (start wall-clock time, seconds) of each."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write("stop\n")
            self._proc.stdin.flush()
            out, _ = self._proc.communicate(timeout=1800)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        if self._proc.returncode != 0:
            raise RuntimeError(f"the Forward client failed with status {self._proc.returncode}")
        report = json.loads(out.strip().splitlines()[-1])
        return list(zip(report["started"], report["latency_s"], strict=True))


#: A stretch of wall-clock time: (start, end).
Window = tuple[float, float]


def _overlapping(calls: list[tuple[float, float]], windows: list[Window]) -> list[float]:
    """The latencies of the calls that overlapped any of ``windows``."""
    return [
        seconds
        for started, seconds in calls
        if any(started <= end and started + seconds >= begin for begin, end in windows)
    ]


def _within(calls: list[tuple[float, float]], windows: list[Window]) -> list[float]:
    """The latencies of the calls that ran entirely inside one of ``windows``."""
    return [
        seconds
        for started, seconds in calls
        if any(begin <= started and started + seconds <= end for begin, end in windows)
    ]


def _forward_during_loads(
    address: str,
    spec: ModelSpec,
    tokens: int,
    idle_seconds: float,
    loads: dict[str, list[tuple[Callable[[], object], Callable[[], object]]]],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """One Forward client calls in a loop for the whole measurement, while each kind's
    (before, load) pairs run one after the other. Ahead of each load, once what comes before it
    (an unload) has settled, a stretch with nothing else running: ``idle_seconds`` in all,
    shared out among the loads. Returns the latencies of the calls inside those quiet
    stretches ("idle") and of those overlapping each kind's loads, and the loads' seconds. The
    quiet stretches sit right before the loads, in the same client session, so a drift of the
    machine over the run (Forward alone has varied by a third between runs) does not show as
    interference."""
    client = _ForwardClient(address, spec, tokens, iters=0)
    client.go()
    time.sleep(0.2)  # the client is calling before anything is measured
    quiet = idle_seconds / max(1, sum(len(works) for works in loads.values()))
    alone: list[Window] = []
    windows: dict[str, list[Window]] = {}
    seconds: dict[str, list[float]] = {}
    try:
        for kind, works in loads.items():
            for before, work in works:
                before()
                time.sleep(0.2)
                begin = time.time()
                time.sleep(quiet)
                alone.append((begin, begin + quiet))
                begin = time.time()
                seconds.setdefault(kind, []).append(_timed(work))
                windows.setdefault(kind, []).append((begin, time.time()))
    finally:
        calls = client.finish()
    latency = {"idle": _within(calls, alone)}
    latency.update((kind, _overlapping(calls, spans)) for kind, spans in windows.items())
    return latency, seconds


@contextmanager
def _executor(
    root: Path, address: str, args: argparse.Namespace, shape: Shape
) -> Iterator[tuple[ExecutorClient, ExecutorRuntime, ExecutorSettings]]:
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
            "download_streams": args.streams,
            "load_threads": args.load_threads,
            "page_cache_dma": args.page_cache_dma,
            "host_cache_reserve": args.host_cache_reserve,
            "load_nice": args.load_nice,
            "gil_switch_interval_us": args.gil_switch_interval_us,
            "kernel_autotune_seconds": 0.0,  # heuristic kernel configs: start at once
            "metrics_listen": "",
            "drain_seconds": 1.0,
            "log_level": "warning",
        }
    )
    configure_process(settings)  # as moelora-executor does
    app = ExecutorApp(settings, ExecutorMetrics(CollectorRegistry()))
    app.start()
    try:
        with ExecutorClient(app.address, timeout=3600) as client:
            client.wait_until_serving(timeout=3600)
            assert app.runtime is not None
            yield client, app.runtime, settings
    finally:
        app.drain()


def _upload(address: str, root: Path, name: str) -> tuple[str, float]:
    with RegistryClient(address, timeout=3600) as registry:
        seconds = _timed(lambda: registry.upload(root / name, name, BASE_NAME, timeout=3600))
    return f"{name}:1", seconds


def _measure_local(root: Path, args: argparse.Namespace, shape: Shape, spec: ModelSpec) -> Results:
    results = Results()
    workdir = root / "registry-local"
    workdir.mkdir()
    with registry_server(workdir, ["--max-rank", str(shape.rank)]) as address:
        with RegistryClient(address, timeout=600) as registry:
            registry.register_base_model(spec.to_proto(BASE_NAME))
        _upload(address, root, "other")
        cold, results.seconds["upload"] = _upload(address, root, "cold")
        if args.forwards:
            for index in range(args.cold_loads):
                _upload(address, root, f"second{index}")
        with _executor(root, address, args, shape) as (client, runtime, settings):
            device = torch.device(args.device)

            def load(ref: str) -> Callable[[], None]:
                def run() -> None:
                    client.load_adapter(ref, to_gpu=True)
                    if device.type == "cuda":  # LoadAdapter returns once the copy is issued
                        torch.cuda.synchronize(device)

                return run

            results.seconds["cold"] = _timed(load(cold))
            client.unload_adapter(cold)
            results.seconds["disk warm"] = _timed(load(cold))
            freed = runtime.adapters.free_slot(AdapterRef.parse(cold), timeout=60)
            assert freed.location is Location.HOST, freed.location
            adapter = freed.adapter
            results.seconds["host warm"] = _timed(load(cold))
            streams = download_streams(settings)
            with RegistryClient(address, timeout=3600, connections=streams) as registry:
                fresh = DiskCache(root / "download-alone", 8 * 1024**3)
                source = RegistrySource(registry, address, fresh, streams, settings.load_nice)

                def download() -> None:
                    files = source.fetch(adapter)
                    try:
                        files.finish()
                    finally:
                        files.close()

                try:
                    results.seconds["download"] = _timed(download)
                finally:
                    source.close()
            folder = settings.disk_cache_dir.expanduser() / adapter.digest.removeprefix("sha256:")
            config = json.loads((folder / CONFIG_FILE).read_text())
            loader = Loader(load_threads(settings.load_threads, device), settings.load_nice)

            def pack(where: torch.device) -> Callable[[], object]:
                return lambda: loader.run(
                    lambda: pack_adapter(
                        config,
                        folder / WEIGHTS_FILE,
                        spec,
                        shape.rank,
                        torch.bfloat16,
                        device=where,
                        page_cache_dma=settings.page_cache_dma,
                        memory=runtime.adapters.host.memory,
                    )
                )

            try:
                results.seconds["pack"] = _timed(pack(device))
                if device.type == "cuda":  # what the GPU's pack saves
                    results.seconds["pack on the CPU"] = _timed(pack(torch.device("cpu")))
            finally:
                loader.close()
            if args.forwards:
                client.pin_adapter(OTHER)
                second = "second0:1"

                def unload() -> None:
                    client.unload_adapter(second)

                latency, results.loads = _forward_during_loads(
                    client.address,
                    spec,
                    args.tokens,
                    args.idle_seconds or (1.0 if device.type == "cuda" else 20.0),
                    {
                        "cold": [
                            (lambda: None, load(f"second{index}:1"))
                            for index in range(args.cold_loads)
                        ],
                        "disk warm": [(unload, load(second))] * args.warm_loads,
                    },
                )
                results.forward.update(latency)
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
            cold, _ = _upload(address, root, "cold")
            with _executor(root, address, args, shape) as (client, _runtime, _settings):
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
        default=1,
        help="1: measure Forward of another adapter during loads; 0: no Forward at all",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=0.0,
        help="Forward alone, in all, in quiet stretches just before each load (0: 1 s on cuda, "
        "20 s on the CPU, where a call takes about half a second)",
    )
    parser.add_argument(
        "--cold-loads",
        type=int,
        default=3,
        help="cold loads (each of a version never seen) during Forward, pooled",
    )
    parser.add_argument(
        "--warm-loads", type=int, default=5, help="disk-warm loads during Forward, pooled"
    )
    parser.add_argument("--backends", default="local,s3", help="comma list: local, s3")
    parser.add_argument("--streams", type=int, default=0, help="--download-streams (0: auto)")
    parser.add_argument("--load-threads", type=int, default=0, help="--load-threads (0: auto)")
    parser.add_argument("--load-nice", type=int, default=19, help="--load-nice")
    parser.add_argument(
        "--page-cache-dma",
        action="store_true",
        help="--page-cache-dma: a CUDA pack copies the files from the page cache",
    )
    parser.add_argument(
        "--host-cache-reserve",
        choices=("auto", "on", "off"),
        default="auto",
        help="--host-cache-reserve",
    )
    parser.add_argument(
        "--gil-switch-interval-us",
        type=int,
        default=ExecutorSettings.model_fields["gil_switch_interval_us"].default,
        help="--gil-switch-interval-us",
    )
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
        if args.forwards:
            for index in range(args.cold_loads):
                write_adapter(root / f"second{index}", spec, shape.rank, seed=3 + index)
        results = _measure_local(root, args, shape, spec) if "local" in backends else Results()
        results.nbytes = nbytes
        if "s3" in backends:
            results.seconds["cold (S3)"] = _measure_s3(root, args, shape, spec)
    _print(results, args, shape)


def _byte_path(device: torch.device, page_cache_dma: bool) -> str:
    """How a load's bytes reach the packing device."""
    if device.type != "cuda":
        return "CPU pack"
    if not page_cache_dma:
        return "staged"
    declined = registration_declined(device)
    return "page-cache DMA" if declined is None else f"staged: {declined}"


def _print(results: Results, args: argparse.Namespace, shape: Shape) -> None:
    device = torch.device(args.device)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()}, {os.cpu_count()} cores"
    )
    streams = download_streams(ExecutorSettings.model_validate({"download_streams": args.streams}))
    dma = _byte_path(device, args.page_cache_dma)
    print(
        f"\nadapter cold start: {results.nbytes / _GB:.3f} GB adapter ({shape.layers} MoE "
        f"layers, rank {shape.rank}, E {shape.num_experts}, H {shape.hidden_size}, "
        f"I {shape.moe_intermediate_size}, bf16), device {args.device} ({where}), "
        f"{streams} download streams, {load_threads(args.load_threads, device)} load threads at "
        f"nice +{args.load_nice}, {dma}, host cache reserve {args.host_cache_reserve}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}\n"
    )
    print("| step | seconds | GB/s |")
    print("|---|---:|---:|")
    for step, seconds in results.seconds.items():
        print(f"| {step} | {seconds:.3f} | {_rate(results.nbytes, seconds)} |")
    idle = results.forward.get("idle")
    if idle:
        base = statistics.median(idle)
        print(
            f"\nForward of another, pinned adapter (T={args.tokens}) from a client process "
            "calling in a loop: alone (just before each load), and while loads run (calls "
            "overlapping a load)\n"
        )
        print(
            "| while | calls | p50 ms | vs alone | p90 ms | loads | load s (median) "
            "| Forward ms lost per load |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for kind, during in results.forward.items():
            p50, p90 = statistics.median(during), _percentile(during, 0.9)
            loads = results.loads.get(kind, [])
            took = f"{statistics.median(loads):.3f}" if loads else "—"
            # What a load costs Forward whatever its length: the calls' time beyond alone's p50.
            lost = f"{sum(t - base for t in during) / len(loads) * 1e3:.1f}" if loads else "—"
            print(
                f"| {'alone' if kind == 'idle' else f'a {kind} load'} | {len(during)} | "
                f"{p50 * 1e3:.2f} | {(p50 / base - 1) * 100:+.0f}% | {p90 * 1e3:.2f} | "
                f"{len(loads) or '—'} | {took} | {lost} |"
            )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    main()
