"""The engine's launch loop alone: how many Forward requests per second one engine prepares,
merges and answers when the layer costs (almost) nothing. ``python -m
executor_service.bench.engine_loop``.

The launch loop is one Python thread; under many clients it, not the GPU, bounds an
executor's throughput (docs/executor.md, "Forward as a client sees it"). This bench measures
its cost per request without a GPU and without gRPC: a tiny CPU checkpoint whose layer is
replaced by ``2 × hidden`` (so every answer can be checked), an engine as the executor runs
it, and fake front ends in processes of their own that speak the engine's wire (descriptors
over its Unix socket, tensors in their shared-memory arenas), each with several threads
keeping a request in flight. It prints requests per second, the loop's busy time per request
(``moelora_executor_launch_loop_busy_seconds_total``) and the mean batch; every answer is
compared with twice its input, and a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.serving.arena import Arena
from executor_service.serving.combiner import CombineLimits, Combiner
from executor_service.serving.engine_link import EngineLink
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import LoRAContext, MoELayerWeights, Routing
from moelora.client.engine_wire import ForwardDescriptor, TensorRef
from moelora.client.model_spec import ModelSpec
from moelora.v1 import tensor_pb2

#: Adapters every request spreads its tokens over (all pinned: no loads in the way).
ADAPTERS = ("a", "b", "c", "d")
BF16 = tensor_pb2.DATA_TYPE_BFLOAT16


@dataclass(frozen=True)
class LoopSettings:
    front_ends: int = 2
    threads: int = 8
    tokens: int = 8
    seconds: float = 8.0
    #: ``--frontend-combine-after`` of the fake front ends (0: every request alone).
    combine_after: int = 2


@dataclass(frozen=True)
class LoopReport:
    settings: LoopSettings
    requests: int
    errors: int
    mismatches: int
    busy_seconds: float
    #: CPU time of the engine's process (every thread) over the timed stretch.
    cpu_seconds: float
    batches: float

    @property
    def per_second(self) -> float:
        return self.requests / self.settings.seconds

    @property
    def busy_us_per_request(self) -> float:
        return 1e6 * self.busy_seconds / max(self.requests, 1)

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.cpu_seconds / max(self.requests, 1)

    @property
    def mean_batch(self) -> float:
        return self.requests / max(self.batches, 1)

    HEADER = (
        "| front ends | threads each | T | combine after | requests/s | loop busy µs/request "
        "| engine CPU µs/request | mean batch | errors | mismatches |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )

    def row(self) -> str:
        s = self.settings
        return (
            f"| {s.front_ends} | {s.threads} | {s.tokens} | {s.combine_after} | "
            f"{self.per_second:,.0f} | {self.busy_us_per_request:.1f} | "
            f"{self.cpu_us_per_request:.1f} | {self.mean_batch:.2f} | "
            f"{self.errors} | {self.mismatches} |"
        )


def doubled(
    hidden: torch.Tensor, _layer: MoELayerWeights, _lora: LoRAContext | None, _r: Routing | None
) -> torch.Tensor:
    """The layer these benches serve: twice the input (every answer can be checked)."""
    return hidden * 2


def doubling_executor(
    root: Path, base: SyntheticBase, listen: str
) -> tuple[ModelSpec, ExecutorSettings]:
    """A checkpoint of ``base`` and rank-4 adapters ``ADAPTERS`` written under ``root``, and
    the settings of a CPU executor on ``listen`` serving them pinned (the benches replace its
    layer by ``doubled``)."""
    spec = write_base_checkpoint(root / "base", base)
    for seed, name in enumerate(ADAPTERS):
        write_adapter(root / "adapters" / name, spec, SyntheticAdapter(rank=4), seed=seed)
    settings = ExecutorSettings.model_validate(
        {
            "listen": listen,
            "base_model_path": root / "base",
            "adapter_dir": root / "adapters",
            "device": "cpu",
            "num_slots": len(ADAPTERS) + 2,
            "max_rank": 8,
            "metrics_listen": "",
            "log_level": "warning",
            "preload_adapters": list(ADAPTERS),
        }
    )
    return spec, settings


def run(settings: LoopSettings) -> LoopReport:
    with tempfile.TemporaryDirectory(prefix="bench-engine-loop-") as tmp:
        root = Path(tmp)
        base = SyntheticBase("qwen3_moe", hidden_size=64, moe_intermediate_size=32)
        spec, executor = doubling_executor(root, base, "127.0.0.1:0")
        registry = CollectorRegistry()
        app = ExecutorApp(executor, ExecutorMetrics(registry), kernel=doubled)
        app.start()
        try:
            if not app.loaded.wait(300) or app.load_error is not None:
                raise RuntimeError(f"the engine did not start: {app.load_error}")
            path = root / "engine.sock"
            app.host.listen(path)
            return _drive(settings, registry, path, spec.moe_layers[0], spec.hidden_size)
        finally:
            app.drain()


def _drive(
    settings: LoopSettings, registry: CollectorRegistry, path: Path, layer: int, hidden: int
) -> LoopReport:
    def sample(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for index in range(settings.front_ends):
        parent, child = context.Pipe()
        process = context.Process(
            target=_front_end, args=(str(path), layer, hidden, settings, index, child)
        )
        process.start()
        pipes.append(parent)
        processes.append(process)
    for parent in pipes:  # connected, arenas written: the timed stretch starts together
        parent.recv()
    busy = sample("moelora_executor_launch_loop_busy_seconds_total")
    batches = sample("moelora_executor_batch_requests_count")
    cpu = time.process_time()
    for parent in pipes:
        parent.send("go")
    counts = [parent.recv() for parent in pipes]
    cpu = time.process_time() - cpu
    report = LoopReport(
        settings=settings,
        requests=sum(c[0] for c in counts),
        errors=sum(c[1] for c in counts),
        mismatches=sum(c[2] for c in counts),
        busy_seconds=sample("moelora_executor_launch_loop_busy_seconds_total") - busy,
        cpu_seconds=cpu,
        batches=sample("moelora_executor_batch_requests_count") - batches,
    )
    for process in processes:
        process.join(30)
    return report


def _front_end(
    path: str, layer: int, hidden: int, settings: LoopSettings, index: int, pipe: Connection
) -> None:
    """A fake front end: ``settings.threads`` threads, each with one request in flight."""
    torch.set_num_threads(1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    tokens = settings.tokens
    nbytes = tokens * hidden * 2
    arena = Arena.create("bench-loop", max(16 * 1024**2, 4 * nbytes * settings.threads))
    link = EngineLink(sock, arena, on_state=lambda _serving, _reason: None)
    link.start()
    limits = CombineLimits(settings.combine_after, max_tokens=512, max_adapters=len(ADAPTERS))
    combiner = Combiner(link, limits)
    per = [tokens // len(ADAPTERS)] * len(ADAPTERS)
    per[-1] += tokens - sum(per)
    segments = tuple((n, a) for n, a in zip(per, ADAPTERS, strict=True) if n)
    counts = [[0, 0, 0] for _ in range(settings.threads)]
    ready = threading.Barrier(settings.threads + 1)

    def work(thread: int) -> None:
        into, out = arena.allocate(nbytes), arena.allocate(nbytes)
        generator = torch.Generator().manual_seed(index * 1000 + thread)
        given = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
        view = arena.view(into)[:nbytes]
        view[:] = given.view(torch.uint8).reshape(-1).numpy().tobytes()
        expected = (given.float() * 2).to(torch.bfloat16).view(torch.int16)
        ref_in = TensorRef("", into.offset, nbytes, BF16, (tokens, hidden))
        ref_out = TensorRef("", out.offset, nbytes, BF16, (tokens, hidden))
        ready.wait()
        ready.wait()  # the go
        stop = time.monotonic() + settings.seconds
        while time.monotonic() < stop:
            descriptor = ForwardDescriptor(
                link.next_id(), layer, 10.0, 0.0, "", ref_in, ref_out, segments
            )
            result = combiner.forward(descriptor)
            counts[thread][0] += 1
            if result.code != 0:
                counts[thread][1] += 1
                continue
            answer = torch.frombuffer(bytearray(arena.view(out)[:nbytes]), dtype=torch.int16)
            if not torch.equal(answer.view(tokens, hidden), expected):
                counts[thread][2] += 1

    threads = [threading.Thread(target=work, args=(t,)) for t in range(settings.threads)]
    for thread in threads:
        thread.start()
    ready.wait()
    pipe.send("ready")
    pipe.recv()
    ready.wait()
    for thread in threads:
        thread.join()
    pipe.send(tuple(sum(c[i] for c in counts) for i in range(3)))
    link.close()
    arena.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--front-ends", type=int, default=LoopSettings.front_ends)
    parser.add_argument("--threads", type=int, default=LoopSettings.threads)
    parser.add_argument("--tokens", type=int, default=LoopSettings.tokens)
    parser.add_argument("--seconds", type=float, default=LoopSettings.seconds)
    parser.add_argument(
        "--combine-after",
        default="0,2",
        help="the front ends' --frontend-combine-after, a row each (comma list)",
    )
    args = parser.parse_args(argv)
    print(LoopReport.HEADER)
    failed = False
    for combine_after in (int(c) for c in args.combine_after.split(",") if c):
        report = run(
            LoopSettings(args.front_ends, args.threads, args.tokens, args.seconds, combine_after)
        )
        print(report.row(), flush=True)
        failed |= bool(report.errors or report.mismatches or not report.requests)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
