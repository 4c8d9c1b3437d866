"""Requests merged into one launch get exactly what each gets alone (float32, CPU), errors stay
per request, slot churn stays safe under merging, and a full queue refuses with a hint."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import grpc
import pytest
import torch

from moelora.client.errors import FailedPrecondition, MoeLoraError, Overloaded
from moelora.client.executor import ExecutorClient, ForwardResult, forward_request
from moelora.v1 import executor_pb2_grpc
from tests.executor.conftest import (
    FOREIGN,
    Placement,
    Running,
    StartExecutor,
    assert_close,
    slowed_kernel,
)
from tests.executor.test_churn import PINNED, _random_segments
from tests.executor.worlds import TOKENS, World

#: Long enough that every client's request is queued before the first launch.
WINDOW_US = 300_000


def _merged(running: Running) -> float:
    """Mean requests per launch so far."""
    count = running.metric("moelora_executor_batch_requests_count")
    return running.metric("moelora_executor_batch_requests_sum") / max(count, 1.0)


def _concurrently(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Runs ``work(i)`` on ``count`` threads started together; their failures, and one for
    each thread that did not finish within two minutes."""
    failures: list[BaseException] = []
    start = threading.Barrier(count)

    def run(index: int) -> None:
        start.wait(10)
        try:
            work(index)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    failures += [TimeoutError(f"{t.name} did not finish") for t in threads if t.is_alive()]
    return failures


def _segments(index: int) -> list[tuple[int, str | None]]:
    """Different adapter mixes, different lengths."""
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(5, "beta"), (7, None)],
        [(3, None), (4, "gamma"), (5, "alpha")],
        [(TOKENS, None)],
        [(6, "delta"), (6, "beta")],
        [(1, "gamma")],
    ]
    return mixes[index % len(mixes)]


def test_merged_requests_equal_each_alone_bit_for_bit(
    qwen_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    """Bit for bit on the CPU; within float32 rounding on the GPU, from CUDA graphs."""
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    running = start_executor(
        qwen_world, num_slots=5, batch_window_us=WINDOW_US, **placement.settings
    )

    def call(client: ExecutorClient, index: int) -> ForwardResult[torch.Tensor]:
        segments = _segments(index)
        tokens = sum(n for n, _ in segments)
        return client.forward(layer, hidden[:tokens] * (1 + index / 10), segments)

    alone = [call(running.client, i) for i in range(6)]
    assert _merged(running) == 1.0
    results: dict[int, ForwardResult[torch.Tensor]] = {}

    def work(index: int) -> None:
        with ExecutorClient(running.app.address, timeout=60) as client:
            results[index] = call(client, index)

    assert not _concurrently(6, work)
    assert _merged(running) > 1.0, "no requests were merged"
    # The dashboard's Forward requests/s counts requests, not the fewer launches.
    requests = running.metric(
        "moelora_executor_forward_requests_by_transport_total", transport="message"
    )
    launches = running.metric("moelora_executor_forward_seconds_count")
    assert requests == 12 and launches < 12, (requests, launches)
    for index, result in results.items():
        placement.same(result.output, alone[index].output)
        assert result.resolved_adapters == alone[index].resolved_adapters
    # And alone is right: against transformers + PEFT.
    segments = _segments(0)
    placement.check(alone[0].output, qwen_world.expected(layer, segments))


def test_a_request_whose_adapter_fails_to_load_fails_alone(
    qwen_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    layer = qwen_world.moe_layers[0]
    running = start_executor(qwen_world, batch_window_us=WINDOW_US, **placement.settings)
    outcomes: dict[int, ForwardResult[torch.Tensor] | MoeLoraError] = {}

    def work(index: int) -> None:
        adapter = FOREIGN if index == 0 else ["alpha", "beta", None][index % 3]
        with ExecutorClient(running.app.address, timeout=60) as client:
            try:
                outcomes[index] = client.forward(
                    layer, qwen_world.inputs[layer], [(TOKENS, adapter)]
                )
            except MoeLoraError as exc:
                outcomes[index] = exc

    assert not _concurrently(5, work)
    assert isinstance(outcomes[0], FailedPrecondition), outcomes[0]
    for index in range(1, 5):
        result = outcomes[index]
        assert isinstance(result, ForwardResult), result
        name = ["alpha", "beta", None][index % 3]
        placement.check(result.output, qwen_world.reference[(name, layer)])


def test_slot_churn_under_merging_never_overwrites_a_slot_in_use(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """The churn test's traffic with merging forced: 3 slots (one pinned) and batches whose
    adapters must fit together, the kernel entered 20 ms after the slots were leased."""
    running = start_executor(
        qwen_world,
        num_slots=3,
        kernel=slowed_kernel(0.02),
        slot_wait_seconds=60,
        batch_window_us=20_000,
    )
    running.client.pin_adapter(PINNED)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        with ExecutorClient(running.app.address, timeout=60) as client:
            for _ in range(6):
                layer = rng.choice(qwen_world.moe_layers)
                segments = _random_segments(rng)
                result = client.forward(layer, qwen_world.inputs[layer], segments)
                assert_close(result.output, qwen_world.expected(layer, segments))

    assert not _concurrently(6, work)
    assert _merged(running) > 1.0
    listing = running.client.list_loaded_adapters().adapters
    assert all(a.in_flight == 0 for a in listing)
    assert running.metric("moelora_executor_adapter_evictions_total", tier="gpu") >= 4


def test_a_full_queue_refuses_with_a_retry_hint(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    layer = qwen_world.moe_layers[0]
    # Requests go to the engine alone: combined, the ones that wait would wait in the front
    # end, which this limit (the engine's queue) does not count.
    running = start_executor(
        qwen_world, kernel=slowed_kernel(0.3), max_queued_requests=1, frontend_combine_after=0
    )
    request = forward_request(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
    codes: list[tuple[grpc.StatusCode, str | None]] = []

    def work(index: int) -> None:
        with grpc.insecure_channel(running.app.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            try:
                stub.Forward(request, timeout=30)
                codes.append((grpc.StatusCode.OK, None))
            except grpc.RpcError as exc:
                assert isinstance(exc, grpc.Call)
                hint = dict(exc.trailing_metadata() or ()).get("moelora-retry-after-ms")
                codes.append((exc.code(), None if hint is None else str(hint)))

    assert not _concurrently(4, work)
    refused = [hint for code, hint in codes if code is grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all(hint is not None and int(hint) >= 1 for hint in refused), codes
    assert (grpc.StatusCode.OK, None) in codes
    assert running.metric("moelora_executor_overloaded_total") == len(refused)
    # The client turns it into Overloaded and retries after the hint: this one gets through.
    with ExecutorClient(running.app.address, timeout=30) as client:
        result = client.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
    assert_close(result.output, qwen_world.reference[("alpha", layer)])
    assert issubclass(Overloaded, MoeLoraError)


@pytest.mark.parametrize("window_us", [0, 2000])
def test_forward_stream_requests_join_the_batches(
    qwen_world: World, start_executor: StartExecutor, window_us: int, placement: Placement
) -> None:
    from moelora.client.executor import ForwardCall

    layer = qwen_world.moe_layers[0]
    running = start_executor(qwen_world, batch_window_us=window_us, **placement.settings)
    calls = [ForwardCall(layer, qwen_world.inputs[layer], _segments(0)) for _ in range(3)]

    def work(index: int) -> None:
        with ExecutorClient(running.app.address, timeout=60) as client:
            if index % 2:
                answers = list(client.forward_stream(calls))
            else:
                answers = [client.forward(c.layer, c.hidden, c.segments) for c in calls]
            for answer in answers:
                assert isinstance(answer, ForwardResult), answer
                placement.check(answer.output, qwen_world.expected(layer, _segments(0)))

    assert not _concurrently(4, work)
