"""Download alone, over each path an executor has: the registry's signed blob URLs (HTTP Range
GETs served with sendfile, received into the file) and its DownloadAdapter stream.

    python -m executor_service.bench.download [--streams N] [--repeat 3] [--paths urls,stream]
                                              [--no-hash] [--small]

The registry runs as its own process on its local-directory store (as in ``make bench-load``);
the executor's ``RegistrySource`` downloads a 1.26 GB PEFT 3D adapter (the bench-load adapter:
Qwen3-30B-A3B's MoE shape, 2 layers at rank 384) into an empty disk cache until every file
matched its sha256, the paths taking turns. Besides GB/s it reports the CPU seconds per GB that
the executor's process and the registry's process spent, which say what a path costs even on a
machine shared with other work, where the rates swing. ``--no-hash`` skips the sha256 (then the
files are not checked: a measurement only) to show what the hashing costs. Linux only (the
registry's CPU time is read from /proc).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from executor_service import arriving
from executor_service.config import ExecutorSettings
from executor_service.disk_cache import DiskCache
from executor_service.registry_source import RegistrySource
from executor_service.runtime import download_streams
from moelora.client.errors import FailedPrecondition
from moelora.client.model_spec import ModelSpec, spec_from_config
from moelora.client.registry import RegistryClient
from moelora.v1 import registry_pb2
from shared.bench_servers import registry_server, write_adapter
from shared.refs import AdapterRef

_GB = 1e9
BASE_NAME = "bench-base"


class _StreamOnly(RegistryClient):
    """The registry as one without blob URLs answers: the source takes the stream."""

    def download_urls(
        self, ref: str, expires_in_seconds: int = 0
    ) -> registry_pb2.GetDownloadUrlsResponse:
        raise FailedPrecondition("no blob URLs (the benchmark's stream path)")


def base_spec(small: bool) -> ModelSpec:
    """bench-load's base shape, from its config alone (the registry needs no weights)."""
    config: dict[str, object] = {
        "model_type": "qwen3_moe",
        "hidden_size": 64 if small else 2048,
        "moe_intermediate_size": 32 if small else 768,
        "intermediate_size": 128 if small else 6144,
        "num_experts": 8 if small else 128,
        "num_experts_per_tok": 2 if small else 8,
        "num_hidden_layers": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
    }
    text = json.dumps(config)
    fingerprint = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return spec_from_config(
        config, config_json=text, checkpoint_dtype="bfloat16", fingerprint=fingerprint
    )


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its child processes (the registry)
    so far."""
    tick = os.sysconf("SC_CLK_TCK")
    children = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            children += (int(fields[11]) + int(fields[12])) / tick
    own = os.times()
    return own.user + own.system, children


@contextmanager
def _hashing(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, arriving files are taken as checked once complete, whole or
    by pieces (measurement only: what the sha256 costs)."""
    if enabled:
        yield
        return
    real = arriving.ArrivingFile._hash, arriving.Inflow._hash

    def complete_only(self: arriving.ArrivingFile) -> None:
        with self._changed:
            while not self._closed and self._error is None and self._prefix() < self.size:
                self._changed.wait()
            self._verified = True
            self._changed.notify_all()

    def pieces_unhashed(self: arriving.Inflow, at: int, view: memoryview) -> list[tuple[int, str]]:
        """The pieces that end within ``view``, taken as matching."""
        pieces, size = self._file.pieces, self._file.size
        if pieces is None:
            return []
        end = at + len(view)
        indices = range(at // pieces.size, min(pieces.count(size), end // pieces.size + 1))
        return [(i, pieces.sha256[i]) for i in indices if at < pieces.span(i, size)[1] <= end]

    arriving.ArrivingFile._hash = complete_only  # type: ignore[method-assign]
    arriving.Inflow._hash = pieces_unhashed  # type: ignore[method-assign]
    try:
        yield
    finally:
        arriving.ArrivingFile._hash, arriving.Inflow._hash = real  # type: ignore[method-assign]


def _download(address: str, path: str, streams: int, disk: Path) -> None:
    client_type = RegistryClient if path == "urls" else _StreamOnly
    with client_type(address, timeout=3600, connections=streams) as client:
        source = RegistrySource(client, address, DiskCache(disk, 64 * 1024**3), streams, nice=0)
        try:
            files = source.fetch(source.resolve(AdapterRef.parse("bench:1")))
            try:
                files.finish()
            finally:
                files.close()
        finally:
            source.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=0, help="parallel ranges (0: auto)")
    parser.add_argument("--repeat", type=int, default=3, help="downloads per path")
    parser.add_argument("--paths", default="urls,stream", help="comma list: urls, stream")
    parser.add_argument("--no-hash", action="store_true", help="skip the sha256 (measurement)")
    parser.add_argument("--small", action="store_true", help="a tiny adapter: a smoke run")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    if any(p not in ("urls", "stream") for p in paths):
        parser.error(f"--paths: {args.paths!r}; use urls and/or stream")
    streams = download_streams(ExecutorSettings.model_validate({"download_streams": args.streams}))
    spec = base_spec(args.small)
    rates: dict[str, list[float]] = {p: [] for p in paths}
    costs: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
    with tempfile.TemporaryDirectory(prefix="bench-download-") as tmp:
        root = Path(tmp)
        nbytes = write_adapter(root / "adapter", spec, 16 if args.small else 384)
        rank = ["--max-rank", "16" if args.small else "384"]
        with registry_server(root, rank) as address, _hashing(not args.no_hash):
            with RegistryClient(address, timeout=3600) as registry:
                registry.register_base_model(spec.to_proto(BASE_NAME))
                registry.upload(root / "adapter", "bench", BASE_NAME, timeout=3600)
            for n in range(args.repeat):
                for path in paths:
                    disk = root / f"disk-{path}-{n}"
                    own, registry_cpu = _cpu_seconds()
                    start = time.perf_counter()
                    _download(address, path, streams, disk)
                    seconds = time.perf_counter() - start
                    own_after, registry_after = _cpu_seconds()
                    shutil.rmtree(disk)
                    gb = nbytes / _GB
                    rates[path].append(gb / seconds)
                    costs[path].append(
                        ((own_after - own) / gb, (registry_after - registry_cpu) / gb)
                    )
                    print(
                        f"{path:6} run {n + 1}: {gb / seconds:.2f} GB/s, CPU s/GB executor "
                        f"{costs[path][-1][0]:.2f} registry {costs[path][-1][1]:.2f}",
                        flush=True,
                    )
    hashed = "not hashed" if args.no_hash else "hashed"
    print(
        f"\ndownload alone: {nbytes / _GB:.3f} GB adapter, {streams} ranged streams, {hashed}, "
        f"{os.cpu_count()} cores, median (best) of {args.repeat}\n"
    )
    print("| path | GB/s | CPU s/GB executor | CPU s/GB registry |")
    print("|---|---:|---:|---:|")
    for path in paths:
        executor = statistics.median(c[0] for c in costs[path])
        registry_side = statistics.median(c[1] for c in costs[path])
        print(
            f"| {path} | {statistics.median(rates[path]):.2f} ({max(rates[path]):.2f}) | "
            f"{executor:.2f} | {registry_side:.2f} |"
        )


if __name__ == "__main__":
    main()
