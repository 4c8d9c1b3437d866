"""One client process of the stress run (``python -m executor_service.bench.stress_client``).

Loads the request pool that the driver wrote (each request's bf16 hidden states and the answer
it must get, memory-mapped so that every client shares one copy) and what its mode needs (torch,
a CUDA context), prints ``ready`` and waits for a line on stdin: the driver releases every
client at once, so that their start-up does not run beside the executor's first requests.
Then until ``--seconds`` pass: picks a random request, sends it the way ``--mode`` says, and
compares every answer with the request's reference, row by row. Prints one JSON line: counts
by status code, mismatches (the first few in detail), the worst row error and the latencies.

Modes (``MODES``): ``unary`` and ``stream`` send bytes with the generated stubs (numpy only);
the others go through the client library as a same-host user would
(``bench.stress_transports``): ``shm`` a registered shared-memory ring, ``device`` CUDA tensors
through ``ExecutorClient``'s own device path (a CUDA ring and a direct channel), ``channel``
an asyncio channel with several calls in flight, reopened now and then with a lease;
``spin`` a blocking channel through its spin block, reopened now and then with a lease;
``network`` a network channel (Gloo from the CPU to a CPU executor, NCCL from a second GPU),
reopened now and then with a lease.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from executor_service.bench.answers import tensor_to_float32, worst_row_error
from moelora.v1 import executor_pb2, executor_pb2_grpc, tensor_pb2

_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]
#: Mismatches described in full in the report (the rest are only counted).
_DETAILED = 5
_CODES = {code.value[0]: code.name for code in grpc.StatusCode}
#: How a client sends its requests (see the module's docstring).
MODES = ("unary", "stream", "shm", "device", "channel", "spin", "network")


@dataclass(frozen=True)
class PoolRequest:
    """One request of the pool, as the driver wrote it."""

    index: int
    layer: int
    segments: list[tuple[int, str]]
    hidden: np.ndarray  # (T, H) uint16: bfloat16 bits
    expected: np.ndarray  # (T, H) float32

    def message(self) -> executor_pb2.ForwardRequest:
        tokens, hidden = self.hidden.shape
        return executor_pb2.ForwardRequest(
            layer=self.layer,
            hidden_states=tensor_pb2.Tensor(
                dtype=tensor_pb2.DATA_TYPE_BFLOAT16,
                shape=[tokens, hidden],
                data=self.hidden.tobytes(),
            ),
            segments=[executor_pb2.Segment(num_tokens=n, adapter=a) for n, a in self.segments],
        )


def write_pool(folder: Path, requests: list[PoolRequest]) -> None:
    """The pool as ``load_pool`` reads it: one .npy per array, the rest in pool.json."""
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for i, request in enumerate(requests):
        np.save(folder / f"hidden-{i}.npy", request.hidden)
        np.save(folder / f"expected-{i}.npy", request.expected)
        items.append({"layer": request.layer, "segments": request.segments})
    (folder / "pool.json").write_text(json.dumps(items))


def load_pool(folder: Path) -> list[PoolRequest]:
    items = json.loads((folder / "pool.json").read_text())
    return [
        PoolRequest(
            index=i,
            layer=int(item["layer"]),
            segments=[(int(n), str(a)) for n, a in item["segments"]],
            hidden=np.load(folder / f"hidden-{i}.npy", mmap_mode="r"),
            expected=np.load(folder / f"expected-{i}.npy", mmap_mode="r"),
        )
        for i, item in enumerate(items)
    ]


#: One call: its status code name, and the output when it is OK.
Answer = tuple[str, tensor_pb2.Tensor | None]


class _Stream:
    """One open ForwardStream: a request out, its answer back."""

    def __init__(self, stub: executor_pb2_grpc.ExecutorStub) -> None:
        self._outbox: queue.Queue[executor_pb2.ForwardStreamRequest | None] = queue.Queue()
        self._answers: Iterator[executor_pb2.ForwardStreamResponse] = stub.ForwardStream(
            self._requests()
        )
        self._next_id = 0

    def _requests(self) -> Iterator[executor_pb2.ForwardStreamRequest]:
        while (item := self._outbox.get()) is not None:
            yield item

    def call(self, request: executor_pb2.ForwardRequest) -> Answer:
        self._next_id += 1
        self._outbox.put(
            executor_pb2.ForwardStreamRequest(request_id=self._next_id, forward=request)
        )
        answer = next(self._answers)
        if answer.request_id != self._next_id:
            return "WRONG_REQUEST_ID", None
        if answer.HasField("error"):
            return _CODES.get(answer.error.code, "UNKNOWN"), None
        return "OK", answer.forward.output

    def close(self) -> None:
        self._outbox.put(None)


def _unary(stub: executor_pb2_grpc.ExecutorStub, request: executor_pb2.ForwardRequest) -> Answer:
    try:
        return "OK", stub.Forward(request, timeout=120).output
    except grpc.RpcError as exc:
        return (exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"), None


def run(
    address: str,
    pool: list[PoolRequest],
    mode: str,
    seconds: float,
    seed: int,
    tolerance: float,
    lease: Sequence[str] = (),
    network_device: str = "cpu",
) -> dict[str, object]:
    """Sends random pool requests for ``seconds``; the report ``main`` prints."""
    rng = random.Random(seed)
    codes: Counter[str] = Counter()
    mismatches: list[dict[str, object]] = []
    mismatched = 0
    latency: list[float] = []
    tokens: list[int] = []
    started: list[float] = []  # each call's start, wall clock (comparable across processes)
    worst = 0.0
    errors: list[str] = []

    def check(item: PoolRequest, code: str, output: np.ndarray | None, took: float) -> None:
        nonlocal mismatched, worst
        latency.append(took)
        tokens.append(item.hidden.shape[0])
        started.append(time.time() - took)
        codes[code] += 1
        if output is None:
            return
        error = worst_row_error(output, np.asarray(item.expected))
        worst = max(worst, error)
        if not error <= tolerance:
            mismatched += 1
            if len(mismatches) < _DETAILED:
                detail = {"request": item.index, "segments": item.segments, "error": error}
                mismatches.append(detail)

    deadline = time.monotonic() + seconds
    if mode not in ("unary", "stream"):
        from executor_service.bench import stress_transports

        errors.extend(
            stress_transports.run(address, pool, mode, deadline, rng, check, lease, network_device)
        )
    else:
        with grpc.insecure_channel(address, options=_OPTIONS) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            stream = _Stream(stub) if mode == "stream" else None
            try:
                while time.monotonic() < deadline:
                    item = rng.choice(pool)
                    request = item.message()
                    begin = time.perf_counter()
                    try:
                        code, output = stream.call(request) if stream else _unary(stub, request)
                    except grpc.RpcError as exc:  # the stream itself broke
                        code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
                        errors.append(f"stream ended: {code}")
                        codes[code] += 1
                        break
                    answer = None if output is None else tensor_to_float32(output)
                    check(item, code, answer, time.perf_counter() - begin)
            finally:
                if stream is not None:
                    stream.close()
    return {
        "mode": mode,
        "codes": dict(codes),
        "mismatched": mismatched,
        "mismatches": mismatches,
        "worst_row_error": worst,
        "latency_s": latency,
        "tokens": tokens,
        "started_at": started,
        "errors": errors,
    }


def _prepare(mode: str, network_device: str) -> None:
    """What ``mode`` needs before its first call: the client library's imports (torch) and,
    for the CUDA transports, this process's CUDA context. The message modes need numpy only."""
    if mode in ("unary", "stream"):
        return
    import torch

    from executor_service.bench import stress_transports  # noqa: F401 (its imports, now)

    device = network_device if mode == "network" else "cuda"
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.zeros(1, device=device)  # creates the context


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--address", required=True)
    parser.add_argument("--pool", type=Path, required=True)
    parser.add_argument("--mode", choices=MODES, default="unary")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, required=True)
    parser.add_argument("--lease", default="", help="channel: adapters to lease, one a channel")
    parser.add_argument("--network-device", default="cpu", help="network: the tensors' device")
    args = parser.parse_args(argv)
    pool = load_pool(args.pool)
    lease = [a for a in args.lease.split(",") if a]
    _prepare(args.mode, args.network_device)
    print("ready", flush=True)
    sys.stdin.readline()  # the driver's word: every client starts at once
    report = run(
        args.address,
        pool,
        args.mode,
        args.seconds,
        args.seed,
        args.tolerance,
        lease,
        args.network_device,
    )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
