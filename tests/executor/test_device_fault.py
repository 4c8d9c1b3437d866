"""Device errors reach callers as what they are. A sticky fault (the CUDA context lost) is
nobody's request's error: health turns NOT_SERVING at once, the requests in flight and new
ones get UNAVAILABLE naming it, it is logged once and counted, and the server stops (the
process then exits: tests/cluster/test_device_fault.py). A failed launch that is not sticky
stays the failing request's own: a merged batch reruns each request alone."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import pytest
import torch

from executor_service.device_fault import is_sticky_device_error
from moelora.client.errors import MoeLoraError, Unavailable
from moelora.client.executor import ExecutorClient
from moelora.client.health import health_check
from tests.executor.conftest import StartExecutor, assert_close
from tests.executor.faults import FAULT_TOKENS, POISON, faulting_kernel, poisoned_kernel
from tests.executor.worlds import TOKENS, World

#: Long enough that every client's request is queued before the first launch.
WINDOW_US = 300_000


def test_sticky_errors_are_told_from_the_others() -> None:
    illegal = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    triton_launch = RuntimeError("Triton Error [CUDA]: unspecified launch failure")
    coded = RuntimeError("driver said so")
    coded.error_code = 719  # type: ignore[attr-defined]  # what torch's CUDA errors carry
    try:
        try:
            raise illegal
        except RuntimeError as inner:
            raise ValueError("while copying the slot ids") from inner
    except ValueError as chained:
        wrapped = chained
    for sticky in (illegal, triton_launch, coded, wrapped):
        assert is_sticky_device_error(sticky), sticky
    for other in (
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("hidden_states.shape"),
        RuntimeError("CUDA error: invalid argument"),
    ):
        assert not is_sticky_device_error(other), other


def test_a_device_fault_turns_callers_away_and_stops_the_server(
    qwen_world: World, start_executor: StartExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    running = start_executor(qwen_world, kernel=faulting_kernel, batch_window_us=WINDOW_US)
    before = running.client.forward(layer, hidden, [(TOKENS, "alpha")])
    assert_close(before.output, qwen_world.expected(layer, [(TOKENS, "alpha")]))

    # Requests in flight beside the faulting one: each answered, none INTERNAL.
    outcomes: list[object] = []
    barrier = threading.Barrier(4)

    def beside() -> None:
        with ExecutorClient(running.app.address, timeout=30) as client:
            barrier.wait(10)
            try:
                outcomes.append(client.forward(layer, hidden, [(TOKENS, "beta")]))
            except MoeLoraError as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=beside) for _ in range(3)]
    for thread in threads:
        thread.start()
    barrier.wait(10)
    big = torch.randn(FAULT_TOKENS, hidden.shape[1])
    with pytest.raises(Unavailable) as raised:
        running.client.forward(layer, big, [(FAULT_TOKENS, None)])
    message = str(raised.value)
    assert "device fault on cpu" in message and "illegal memory access" in message, message
    with grpc.insecure_channel(running.app.address) as channel:
        assert health_check(channel) == "NOT_SERVING"
    with pytest.raises(Unavailable, match="device fault on cpu"):
        running.client.forward(layer, hidden, [(TOKENS, "alpha")])
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 3, "a request beside the fault got no answer"
    assert all(not isinstance(o, MoeLoraError) or isinstance(o, Unavailable) for o in outcomes)
    assert running.app.faulted.is_set() and running.app.device_fault is not None
    assert running.metric("moelora_executor_device_faults_total") == 1
    faults = [r for r in caplog.records if r.getMessage() == "device_fault"]
    assert len(faults) == 1 and faults[0].levelno == logging.CRITICAL
    assert running.app.device_fault.error_id in message
    assert running.app.server.wait(15), "the server did not stop after the fault"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (lambda: ValueError("a kernel bug this request triggers"), grpc.StatusCode.INTERNAL),
        (
            lambda: torch.OutOfMemoryError("CUDA out of memory"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    ],
    ids=["kernel-exception", "out-of-memory"],
)
def test_a_failed_merged_launch_fails_only_the_request_that_fails_alone(
    qwen_world: World,
    start_executor: StartExecutor,
    error: Callable[[], BaseException],
    code: grpc.StatusCode,
) -> None:
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    launches: list[int] = []
    running = start_executor(
        qwen_world, kernel=poisoned_kernel(error, launches), batch_window_us=WINDOW_US
    )
    poisoned = hidden.clone()
    poisoned[0, 0] = POISON
    mixes: list[tuple[torch.Tensor, str | None]] = [
        (poisoned, "alpha"),
        (hidden, "alpha"),
        (hidden, "beta"),
        (hidden, None),
    ]
    outcomes: dict[int, object] = {}
    barrier = threading.Barrier(len(mixes))

    def work(index: int) -> None:
        rows, adapter = mixes[index]
        with ExecutorClient(running.app.address, timeout=30) as client:
            barrier.wait(10)
            try:
                outcomes[index] = client.forward(layer, rows, [(TOKENS, adapter)]).output
            except MoeLoraError as exc:
                outcomes[index] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(mixes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes) == list(range(len(mixes))), "a request got no answer"
    failed = outcomes[0]
    assert isinstance(failed, MoeLoraError) and failed.code is code, failed
    for index in range(1, len(mixes)):
        output = outcomes[index]
        assert isinstance(output, torch.Tensor), output
        assert_close(output, qwen_world.expected(layer, [(TOKENS, mixes[index][1])]))
    assert max(launches) > TOKENS, f"nothing merged: {launches}"
    assert all(a.in_flight == 0 for a in running.client.list_loaded_adapters().adapters)
    with grpc.insecure_channel(running.app.address) as channel:
        assert health_check(channel) == "SERVING"
