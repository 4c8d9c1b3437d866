"""Forward as a client backend sees it: ``python -m executor_service.bench.forward``.

Writes a one-layer synthetic checkpoint of a real shape (default: a Qwen3-30B-A3B MoE layer,
H=2048, I=768, E=128, k=8) with rank-16 PEFT adapters, starts the executor as its own process
(``python -m executor_service.main``) and a bare grpcio echo server (``bench.echo_server``), and
runs clients as separate processes (``bench.clients``: plain generated stubs, bf16 on the wire,
tokens split evenly over 4 adapters per request). Rows, each for unary Forward and for
ForwardStream: T = 1, 8, 64, 512 with one client; T = 64 with 8 and 32 clients (the last row
draws its adapters from a pool larger than the executor's slots, so batches churn slots).

Columns: p50 and p99 round trip; the executor's ``server_time_us`` p50; the kernel alone
(CUDA-graph replay of the same T on the GPU, the eager torch reference on the CPU); the
transport floor (the echo server, same bytes, same clients, as many server processes as the
executor has front ends); overhead = p50 − kernel − floor; tokens/s over the row; the mean
number of requests per launch (from the executor's metrics). Then the executor's mean time per
stage for each row, and the CPU time each call cost the servers (their whole process trees)
and the clients, with the host cores that kept busy: where a row is bound by the host's CPU
rather than the executor.

``--shape tiny --device cpu`` runs in seconds (CI runs it through a test).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from executor_service.bench import stress, stress_client
from executor_service.bench.answers import row_tolerance
from executor_service.bench.clients import forward_request
from executor_service.bench.processes import child_process, progress, tree_cpu_seconds
from executor_service.bench.reference import EagerReference
from executor_service.bench.shapes import SHAPES
from executor_service.bench.stats import percentile
from executor_service.graphs import GraphCache
from executor_service.metrics import STAGES
from executor_service.model_loader import load_base_model
from executor_service.serving.frontends import frontend_count
from executor_service.synthetic import SyntheticAdapter, write_adapter, write_base_checkpoint
from kernels import LoRAContext, LoRASlots, moe_forward
from kernels.forward import Backend
from moelora.client.executor import ExecutorClient
from shared.ports import free_port

#: Adapters per request; the pinned pool every row but the churn row draws from.
PER_REQUEST = 4
#: The stage table's last column (``moelora_executor_forward_seconds``).
LAUNCH = "launch"


@dataclass(frozen=True)
class Row:
    mode: str
    tokens: int
    clients: int
    p50_ms: float
    p99_ms: float
    server_ms: float
    kernel_ms: float | None
    #: None where no echo applies (``--transport channel``).
    floor_ms: float | None
    tokens_per_s: float
    batch: float
    stages_ms: dict[str, float]
    churn: bool
    #: Answers compared with the reference, those beyond the tolerance, the worst row error.
    checked: int
    mismatched: int
    worst_row_error: float
    #: The executor's and its clients' CPU, and the echo's and its clients' (None: no echo).
    cpu: ClientsRun
    floor_cpu: ClientsRun | None


def _say(message: str) -> None:
    progress("bench", message)


def _stop(signum: int, _frame: object) -> None:
    # Unwind (so that the executor, echo and client processes are stopped), then exit.
    raise SystemExit(128 + signum)


def _metrics(url: str) -> dict[str, float]:
    """The executor's Prometheus samples (name{labels} -> value)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(moelora_executor_\S+?)\s+(\S+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def _delta_mean(
    after: dict[str, float], before: dict[str, float], name: str, labels: str = ""
) -> float:
    """Mean of a histogram's observations between two scrapes."""
    total, count = (
        after.get(f"{name}_{part}{labels}", 0.0) - before.get(f"{name}_{part}{labels}", 0.0)
        for part in ("sum", "count")
    )
    return total / count if count else 0.0


def run_clients(
    address: str,
    layer: int,
    target: str,
    mode: str,
    tokens: int,
    hidden: int,
    adapter_sets: list[list[str]],
    iters: int,
    warmup: int,
    answers: AnswerFiles | None = None,
    transport: str = "grpc",
    server: int | None = None,
    client_device: str = "cuda",
) -> ClientsRun:
    """Runs one row's clients (client i sends the request of seed i); with ``answers`` each
    checks a sample of its answers against its request's expected answer. ``server``: the
    process whose tree's CPU time the timed calls are charged (from "go" to the last
    answer)."""
    procs = []
    for i, adapters in enumerate(adapter_sets):
        check = [] if answers is None else answers.arguments(tokens, i, adapters)
        command = [
            sys.executable,
            "-m",
            "executor_service.bench.clients",
            f"--address={address}",
            f"--target={target}",
            f"--mode={mode}",
            f"--layer={layer}",
            f"--tokens={tokens}",
            f"--hidden={hidden}",
            f"--adapters={','.join(adapters)}",
            f"--iters={iters}",
            f"--warmup={warmup}",
            f"--seed={i}",
            f"--transport={transport}",
            f"--device={client_device}",
            *check,
        ]
        procs.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    try:
        for proc in procs:
            assert proc.stdout is not None
            # A client that cannot get through its warm-up must not hang the benchmark.
            if not select.select([proc.stdout], [], [], 600)[0]:
                raise RuntimeError("a bench client did not finish its warm-up in 600 s")
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"a bench client failed to start (said {line!r})")
        server_cpu = 0.0 if server is None else tree_cpu_seconds(server)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"a bench client failed with status {proc.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        if server is not None:
            server_cpu = tree_cpu_seconds(server) - server_cpu
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    latency = [x for r in results for x in r["latency_s"]]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    client_cpu = sum(r["cpu_s"] for r in results)
    return ClientsRun(
        latency=latency,
        client_cpu_ms=1e3 * client_cpu / len(latency),
        server_cpu_ms=None if server is None else 1e3 * server_cpu / len(latency),
        cores_busy=(client_cpu + server_cpu) / span,
        server_us=[x for r in results for x in r["server_us"]],
        tokens_per_s=len(latency) * tokens / span,
        checked=sum(r["checked"] for r in results),
        mismatched=sum(r["mismatched"] for r in results),
        worst_row_error=max(r["worst_row_error"] for r in results),
    )


class AnswerFiles(Protocol):
    """Where each client finds its expected answer: ``bench.clients`` arguments."""

    def arguments(self, tokens: int, client: int, adapters: list[str]) -> list[str]: ...


@dataclass(frozen=True)
class ClientsRun:
    """What one row's clients measured and checked."""

    latency: list[float]
    #: CPU time per call (every thread) of the clients, and of the server's process tree.
    client_cpu_ms: float
    server_cpu_ms: float | None
    #: (clients' + server's CPU seconds) / the row's seconds: host cores kept busy.
    cores_busy: float
    server_us: list[int]
    tokens_per_s: float
    checked: int
    mismatched: int
    worst_row_error: float


class Answers:
    """The expected answer of every request the rows send, computed alone and eagerly
    (``bench.reference``) before the executor starts, one .npy file each."""

    def __init__(self, reference: EagerReference, folder: Path, layer: int, hidden: int) -> None:
        self._reference = reference
        self._folder = folder
        self._layer = layer
        self._hidden = hidden
        self.tolerance = 0.0

    def prepare(self, tokens: int, client: int, adapters: list[str]) -> None:
        path = self._path(tokens, client, adapters)
        if path.exists():
            return
        request = forward_request(self._layer, tokens, self._hidden, adapters, client)
        bits = np.frombuffer(request.hidden_states.data, dtype="<u2").reshape(tokens, -1)
        segments = [(s.num_tokens, s.adapter) for s in request.segments]
        np.save(path, self._reference.forward(self._layer, bits, segments))

    def arguments(self, tokens: int, client: int, adapters: list[str]) -> list[str]:
        path = self._path(tokens, client, adapters)
        return [f"--expected={path}", f"--tolerance={self.tolerance}"]

    def _path(self, tokens: int, client: int, adapters: list[str]) -> Path:
        return self._folder / f"T{tokens}-seed{client}-{'+'.join(adapters)}.npy"


def _kernel_timer(
    checkpoint: Path, device: torch.device, rank: int, slots: int
) -> Callable[[int], float]:
    """Milliseconds of the layer forward alone at T tokens with 4 adapters: CUDA-graph replay
    on a GPU (median of CUDA-event times), the eager torch reference on the CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_base_model(checkpoint, device, dtype)
    index, layer = next(iter(model.layers.items()))
    e, h, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.02).to(device, dtype)

    lora = LoRASlots(
        a13=rand(slots, e, rank, h),
        b13=rand(slots, e, 2 * inter, rank),
        a2=rand(slots, e, rank, inter),
        b2=rand(slots, e, h, rank),
        enabled=torch.ones(slots, dtype=torch.int32, device=device),
    )
    backend: Backend = "triton" if device.type == "cuda" else "torch"

    def kernel(x: torch.Tensor, w: object, ctx: LoRAContext | None, r: object) -> torch.Tensor:
        return moe_forward(x, layer, ctx, None, backend=backend)

    graphs = None
    if device.type == "cuda":
        graphs = GraphCache(kernel, model.layers, lambda _: lora, device, dtype)
        graphs.capture_all()

    def time_ms(tokens: int) -> float:
        token_slots = (torch.arange(tokens, dtype=torch.int32) * PER_REQUEST // tokens).to(device)
        if graphs is not None:
            bucket = graphs.bucket(tokens) or tokens
            graph = graphs.get(index, bucket)
            assert graph is not None, "CUDA-graph capture failed; see the log"
            x = torch.randn(tokens, h, generator=generator).to(dtype)
            graphs.staging.fill([x], token_slots.cpu(), pad_to=bucket)
            samples = []
            for _ in range(50):
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                samples.append(float(start.elapsed_time(end)))
            return statistics.median(samples)
        x = torch.randn(tokens, h, generator=generator).to(dtype)
        ctx = LoRAContext(lora, token_slots)
        samples = []
        for _ in range(20):
            begin = time.perf_counter()
            moe_forward(x, layer, ctx, None, backend=backend)
            samples.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(samples)

    return time_ms


def _adapter_sets(pool: list[str], clients: int) -> list[list[str]]:
    """PER_REQUEST adapters per client, rotating through ``pool``."""
    return [
        [pool[(c * PER_REQUEST + j) % len(pool)] for j in range(PER_REQUEST)]
        for c in range(clients)
    ]


def _print(rows: list[Row], title: str, front_ends: int) -> None:
    print(f"\n{title}\n")
    print(
        "| mode | T | clients | front ends | p50 ms | p99 ms | server p50 ms | kernel ms | "
        "floor ms | overhead ms | tokens/s | mean batch | answers checked (worst row error) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kernel = "—" if r.kernel_ms is None else f"{r.kernel_ms:.3f}"
        floor = "—" if r.floor_ms is None else f"{r.floor_ms:.3f}"
        overhead = (
            "—" if r.kernel_ms is None else f"{r.p50_ms - r.kernel_ms - (r.floor_ms or 0.0):.3f}"
        )
        clients = f"{r.clients}{' (churn)' if r.churn else ''}"
        print(
            f"| {r.mode} | {r.tokens} | {clients} | {front_ends} | {r.p50_ms:.3f} | "
            f"{r.p99_ms:.3f} | {r.server_ms:.3f} | {kernel} | {floor} | {overhead} | "
            f"{r.tokens_per_s:,.0f} | {r.batch:.2f} | {r.checked} ({r.worst_row_error:.1e}) |"
        )
    print(
        "\nExecutor time per stage, mean ms per request (decode, dispatch, prepare, queue) or "
        f"per launch (the others; {LAUNCH}: the whole launch on the loop, from leasing slots "
        "to the outputs written)\n"
    )
    columns = (*STAGES, LAUNCH)
    print("| mode | T | clients | " + " | ".join(columns) + " |")
    print("|---|---:|---:|" + "---:|" * len(columns))
    for r in rows:
        stages = " | ".join(f"{r.stages_ms.get(s, 0.0):.3f}" for s in columns)
        print(f"| {r.mode} | {r.tokens} | {r.clients} | {stages} |")
    print(
        "\nCPU time per call, ms (every thread of the processes), and host cores kept busy: "
        "the executor (engine and front ends) and its clients; the echo floor and its clients\n"
    )
    print(
        "| mode | T | clients | executor CPU | clients' CPU | cores busy | "
        "echo CPU | echo clients' CPU | cores busy (echo) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        echo = "— | — | —"
        if r.floor_cpu is not None:
            f = r.floor_cpu
            echo = f"{f.server_cpu_ms or 0.0:.3f} | {f.client_cpu_ms:.3f} | {f.cores_busy:.1f}"
        c = r.cpu
        print(
            f"| {r.mode} | {r.tokens} | {r.clients} | {c.server_cpu_ms or 0.0:.3f} | "
            f"{c.client_cpu_ms:.3f} | {c.cores_busy:.1f} | {echo} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="1,8,64,512", help="T of the one-client rows")
    parser.add_argument("--clients", default="8,32,64", help="client counts of the T=64 rows")
    parser.add_argument(
        "--transport",
        choices=["grpc", "shm", "cuda", "channel", "spin", "network"],
        default="grpc",
        help="grpc: tensors in the messages; shm / cuda: in a shared-memory / CUDA-memory "
        "region (on the executor's GPU) each client registers once, the RPC carrying only the "
        "descriptor; channel: that CUDA region and the descriptor over a direct channel to the "
        "engine (OpenChannel), no RPC per call; spin: the same through the channel's spin "
        "block, polled by both ends; network: a network channel from the clients' "
        "--client-device (descriptors over TCP, tensors over NCCL). No echo floor for channel, "
        "spin and network: the overhead is p50 - kernel",
    )
    parser.add_argument(
        "--client-device",
        default="cuda",
        help="the clients' GPU for --transport network (e.g. cuda:1 beside --device cuda:0)",
    )
    parser.add_argument(
        "--frontends", type=int, help="the executor's --frontends (default: its own)"
    )
    parser.add_argument("--modes", default="unary,stream")
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="serve an FP8 checkpoint (experts F8_E4M3 with 128x128 block scales)",
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="the executor's --num-slots")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per client and row")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--batch-window-us", type=int, default=0)
    parser.add_argument(
        "--stress",
        type=float,
        metavar="SECONDS",
        help="instead of the table: the stress run (bench/stress.py) for this long",
    )
    parser.add_argument("--stress-clients", type=int, default=32)
    parser.add_argument(
        "--stress-modes",
        default="",
        help="the stress clients' modes, taken in turn (comma list of "
        + ", ".join(stress_client.MODES)
        + "); default: every mode the device runs",
    )
    args = parser.parse_args(argv)
    unknown = set(args.stress_modes.split(",")) - {"", *stress_client.MODES}
    if unknown:
        parser.error(f"--stress-modes: no such mode {sorted(unknown)}")
    signal.signal(signal.SIGTERM, _stop)
    if args.stress is not None:
        report = stress.run(
            stress.StressSettings(
                seconds=args.stress,
                device=args.device,
                shape=args.shape,
                clients=args.stress_clients,
                slots=args.slots,
                max_rank=args.rank,
                cuda_graphs=args.cuda_graphs,
                modes=tuple(m for m in args.stress_modes.split(",") if m) or None,
            )
        )
        print(report.table())
        raise SystemExit(1 if report.failures() else 0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    client_counts = [int(c) for c in args.clients.split(",") if c]
    # The last multi-client row draws from more adapters than there are slots.
    churn_pool = 2 * args.slots
    names = [f"bench-{i}:1" for i in range(churn_pool)]
    pinned = names[:PER_REQUEST]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp:
        root = Path(tmp)
        _say(f"writing the {args.shape} checkpoint and {churn_pool} adapters")
        spec = write_base_checkpoint(root / "base", SHAPES[args.shape], dtype=dtype, fp8=args.fp8)
        for seed in range(churn_pool):
            write_adapter(
                root / "adapters" / f"bench-{seed}",
                spec,
                SyntheticAdapter(rank=args.rank),
                seed=seed,
            )
        layer = spec.moe_layers[0]
        plan = [(int(t), 1, False) for t in args.tokens.split(",") if t]
        plan += [(64, n, i == len(client_counts) - 1) for i, n in enumerate(client_counts)]
        _say("computing the expected answers alone, eagerly")
        reference = EagerReference(
            root / "base", root / "adapters", args.device, args.rank, root / "ref-cache"
        )
        answers = Answers(reference, root, layer, spec.hidden_size)
        answers.tolerance = row_tolerance(args.device)
        try:
            for tokens, clients, churn in plan:
                for i, adapters in enumerate(_adapter_sets(names if churn else pinned, clients)):
                    answers.prepare(tokens, i, adapters)
        finally:
            reference.close()
            del reference
        kernel_ms = _kernel_timer(root / "base", device, args.rank, args.slots)
        _say("starting the executor and the echo server")
        port, metrics_port = free_port(), free_port()
        address = f"127.0.0.1:{port}"
        executor = [
            sys.executable,
            "-m",
            "executor_service.main",
            f"--listen={address}",
            f"--metrics-listen=127.0.0.1:{metrics_port}",
            f"--base-model-path={root / 'base'}",
            f"--adapter-dir={root / 'adapters'}",
            f"--device={args.device}",
            f"--num-slots={args.slots}",
            f"--max-rank={args.rank}",
            f"--cuda-graphs={args.cuda_graphs}",
            f"--batch-window-us={args.batch_window_us}",
            "--log-level=info",
            *([] if args.frontends is None else [f"--frontends={args.frontends}"]),
            *(
                ["--network-channel-port=0", "--network-channel-host=127.0.0.1"]
                if args.transport == "network"
                else []
            ),
        ]
        front_ends = max(1, frontend_count(args.frontends))
        echo = [
            sys.executable,
            "-m",
            "executor_service.bench.echo_server",
            "--listen=127.0.0.1:0",
            "--workers=64",  # as many handler threads as the executor: one per open stream
            f"--processes={front_ends}",  # as many GILs as the executor's front ends
        ]
        env = {**os.environ, "MOELORA_REGISTRY_ADDRESS": ""}
        with child_process(executor, env) as executor_proc, child_process(echo) as echo_proc:
            assert echo_proc.stdout is not None
            echo_address = f"127.0.0.1:{echo_proc.stdout.readline().strip()}"
            with ExecutorClient(address, timeout=600) as client:
                client.wait_until_serving(timeout=600)
                _say("executor serving")
                for name in pinned:
                    client.pin_adapter(name)
                info = client.get_executor_info()
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            for mode in args.modes.split(","):
                for tokens, clients, churn in plan:
                    sets = _adapter_sets(names if churn else pinned, clients)
                    before = _metrics(metrics_url)
                    served = run_clients(
                        address,
                        layer,
                        "executor",
                        mode,
                        tokens,
                        spec.hidden_size,
                        sets,
                        args.iters,
                        args.warmup,
                        answers,
                        args.transport,
                        executor_proc.pid,
                        args.client_device,
                    )
                    latency = served.latency
                    after = _metrics(metrics_url)
                    floor = None
                    # No gRPC echo to compare for the channels.
                    if args.transport not in ("channel", "spin", "network"):
                        floor = run_clients(
                            echo_address,
                            layer,
                            "echo",
                            mode,
                            tokens,
                            spec.hidden_size,
                            sets,
                            args.iters,
                            args.warmup,
                            transport=args.transport,
                            server=echo_proc.pid,
                        )
                    stages = {
                        s: 1e3
                        * _delta_mean(
                            after, before, "moelora_executor_stage_seconds", f'{{stage="{s}"}}'
                        )
                        for s in STAGES
                    }
                    stages[LAUNCH] = 1e3 * _delta_mean(
                        after, before, "moelora_executor_forward_seconds"
                    )
                    rows.append(
                        Row(
                            mode=mode,
                            tokens=tokens,
                            clients=clients,
                            p50_ms=1e3 * statistics.median(latency),
                            p99_ms=1e3 * percentile(latency, 0.99),
                            server_ms=statistics.median(served.server_us) / 1e3,
                            kernel_ms=kernel_ms(tokens) if clients == 1 else None,
                            floor_ms=(
                                None if floor is None else 1e3 * statistics.median(floor.latency)
                            ),
                            tokens_per_s=served.tokens_per_s,
                            batch=_delta_mean(after, before, "moelora_executor_batch_requests"),
                            stages_ms=stages,
                            churn=churn,
                            checked=served.checked,
                            mismatched=served.mismatched,
                            worst_row_error=served.worst_row_error,
                            cpu=served,
                            floor_cpu=floor,
                        )
                    )
                    _say(f"row done: {rows[-1]}")
    wrong = [r for r in rows if r.mismatched or not r.checked]
    if wrong:
        for r in wrong:
            print(
                f"WRONG ANSWERS: {r.mode} T={r.tokens} clients={r.clients}: {r.mismatched} of "
                f"{r.checked} checked answers differ from the reference (worst row error "
                f"{r.worst_row_error:.3g}, tolerance {answers.tolerance:g})",
                file=sys.stderr,
            )
        raise SystemExit("bench.forward: answers differ from the reference; no table printed")
    _print(
        rows,
        f"Forward over {args.transport}, {args.shape} layer on {info.device} ({info.backend}), "
        f"experts {info.weight_format}, compute {str(dtype).removeprefix('torch.')}, "
        f"bf16 tensors, rank {args.rank}, "
        f"{PER_REQUEST} adapters per request ({len(pinned)} pinned; churn row: {churn_pool} "
        f"adapters over {args.slots} slots), {args.iters} calls per client and row",
        frontend_count(args.frontends),
    )


if __name__ == "__main__":
    main()
