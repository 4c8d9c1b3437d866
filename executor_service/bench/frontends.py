"""The gRPC front ends alone: what a Forward costs the executor's front-end processes when the
layer costs (almost) nothing. ``python -m executor_service.bench.frontends``.

On a GPU host the front ends, not the engine, bound an executor's requests per second
(docs/executor.md, "Forward as a client sees it"); this bench measures them without a GPU. Real
front-end processes (``serving.frontends.FrontEnds``, as ``moelora-executor`` runs them) share
one port and hand their requests to an engine in this process whose layer is replaced by
``2 × hidden`` (``bench.engine_loop``'s), over a synthetic checkpoint of ``--hidden`` width
(the bytes of a real layer's rows). Bench client processes (``bench.clients``: bf16 bytes in
the message) call Forward; every warm-up answer and a sample of the timed ones are compared
with twice their input. Beside each row, the same clients call the bare echo server with as
many processes (the transport floor). Per row: requests/s, p50/p99, and the CPU time per call
of the front ends, of the engine's process and of the clients, against the echo's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.bench import engine_loop
from executor_service.bench.clients import forward_request
from executor_service.bench.engine_loop import doubled, doubling_executor
from executor_service.bench.forward import ClientsRun, run_clients
from executor_service.bench.processes import child_process, progress, tree_cpu_seconds
from executor_service.bench.stats import percentile
from executor_service.metrics import ExecutorMetrics
from executor_service.serving.frontends import FrontEnds
from executor_service.synthetic import SyntheticBase
from moelora.client.executor import ExecutorClient
from shared.ports import free_port

#: Adapters each request spreads its tokens over (all pinned: no loads in the way).
ADAPTERS = [f"{name}:1" for name in engine_loop.ADAPTERS]


@dataclass(frozen=True)
class FrontEndRow:
    clients: int
    tokens: int
    run: ClientsRun
    #: CPU ms per call of the front-end processes and of the engine's process.
    front_ends_cpu_ms: float
    engine_cpu_ms: float
    floor: ClientsRun

    HEADER = (
        "| clients | requests/s | p50 ms | p99 ms | front ends CPU ms | engine CPU ms | "
        "clients' CPU ms | echo p50 ms | echo CPU ms | echo clients' CPU ms | "
        "answers checked (worst) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )

    def row(self) -> str:
        r, f = self.run, self.floor
        per_second = r.tokens_per_s / self.tokens
        return (
            f"| {self.clients} | {per_second:,.0f} | {_ms(r.latency, 0.5)} | "
            f"{_ms(r.latency, 0.99)} | {self.front_ends_cpu_ms:.3f} | {self.engine_cpu_ms:.3f} | "
            f"{r.client_cpu_ms:.3f} | {_ms(f.latency, 0.5)} | {f.server_cpu_ms or 0.0:.3f} | "
            f"{f.client_cpu_ms:.3f} | {r.checked} ({r.worst_row_error:.1e}) |"
        )


def _ms(latency: list[float], q: float) -> str:
    return f"{1e3 * percentile(latency, q):.3f}"


class _Doubled:
    """Each client's expected answer: twice its request's rows (exact in bf16)."""

    def __init__(self, folder: Path, layer: int, hidden: int) -> None:
        self._folder, self._layer, self._hidden = folder, layer, hidden

    def arguments(self, tokens: int, client: int, adapters: list[str]) -> list[str]:
        path = self._folder / f"T{tokens}-seed{client}.npy"
        if not path.exists():
            request = forward_request(self._layer, tokens, self._hidden, adapters, client)
            bits = np.frombuffer(request.hidden_states.data, dtype="<u2").astype(np.uint32)
            np.save(path, (bits << 16).view(np.float32).reshape(tokens, -1) * 2)
        return [f"--expected={path}", "--tolerance=0"]


def run(
    front_ends: int, clients: list[int], tokens: int, hidden: int, iters: int, warmup: int
) -> list[FrontEndRow]:
    with tempfile.TemporaryDirectory(prefix="bench-frontends-") as tmp:
        root = Path(tmp)
        progress("frontends", f"writing a checkpoint of hidden size {hidden}")
        base = SyntheticBase(
            "qwen3_moe", hidden_size=hidden, moe_intermediate_size=32, num_layers=1, num_experts=4
        )
        port = free_port()
        spec, settings = doubling_executor(root, base, f"127.0.0.1:{port}")
        # The engine's own in-process gRPC server takes another port; only the front ends'
        # is called.
        embedded = settings.model_copy(update={"listen": "127.0.0.1:0"})
        app = ExecutorApp(embedded, ExecutorMetrics(CollectorRegistry()), kernel=doubled)
        app.start()
        (root / "metrics").mkdir()
        processes = FrontEnds(settings, root / "engine.sock", front_ends, root / "metrics")
        try:
            if not app.loaded.wait(300) or app.load_error is not None:
                raise RuntimeError(f"the engine did not start: {app.load_error}")
            app.host.listen(root / "engine.sock")
            processes.start()
            address = f"127.0.0.1:{port}"
            with ExecutorClient(address, timeout=120) as client:
                client.wait_until_serving(timeout=120)
            echo = [
                sys.executable, "-m", "executor_service.bench.echo_server",
                "--listen=127.0.0.1:0", "--workers=64", f"--processes={front_ends}",
            ]  # fmt: skip
            answers = _Doubled(root, spec.moe_layers[0], hidden)
            rows = []
            with child_process(echo) as echo_proc:
                assert echo_proc.stdout is not None
                echo_address = f"127.0.0.1:{echo_proc.stdout.readline().strip()}"
                for count in clients:
                    progress("frontends", f"{count} clients")
                    row = _row(
                        processes, address, echo_address, echo_proc.pid, count, tokens, hidden,
                        iters, warmup, answers, spec.moe_layers[0],
                    )  # fmt: skip
                    rows.append(row)
            return rows
        finally:
            processes.stop(grace=2.0)
            app.drain()


def _row(
    processes: FrontEnds,
    address: str,
    echo_address: str,
    echo_pid: int,
    clients: int,
    tokens: int,
    hidden: int,
    iters: int,
    warmup: int,
    answers: _Doubled,
    layer: int,
) -> FrontEndRow:
    sets = [ADAPTERS] * clients
    pids = processes.pids
    front_ends = sum(tree_cpu_seconds(p) for p in pids)
    engine = time.process_time()
    run = run_clients(
        address, layer, "executor", "unary", tokens, hidden, sets, iters, warmup, answers
    )
    engine = time.process_time() - engine
    front_ends = sum(tree_cpu_seconds(p) for p in pids) - front_ends
    floor = run_clients(
        echo_address, layer, "echo", "unary", tokens, hidden, sets, iters, warmup, None,
        server=echo_pid,
    )  # fmt: skip
    calls = max(1, len(run.latency))
    return FrontEndRow(clients, tokens, run, 1e3 * front_ends / calls, 1e3 * engine / calls, floor)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--clients", default="1,8", help="client counts, a row each")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",") if c]
    rows = run(args.frontends, counts, args.tokens, args.hidden, args.iters, args.warmup)
    print(
        f"Front ends alone: {args.frontends} front ends, T = {args.tokens} x H = {args.hidden} "
        f"bf16 over {len(ADAPTERS)} adapters, {args.iters} calls per client (CPU per call: "
        "every thread of the processes)\n"
    )
    print(FrontEndRow.HEADER)
    for row in rows:
        print(row.row())
    if any(r.run.mismatched or not r.run.checked for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
