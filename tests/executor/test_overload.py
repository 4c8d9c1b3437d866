"""Overload: idle or slow ForwardStream clients cannot take every handler thread (streams past
--max-forward-streams are refused with a retry hint, unary calls still answer), and a client's
deadline ends its call on time however slow the executor is. (A full request queue:
test_batching; huge declared shapes: tests/fuzz.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from moelora.client.errors import DeadlineExceeded
from moelora.client.executor import forward_request
from moelora.v1 import executor_pb2, executor_pb2_grpc
from tests.executor.conftest import Placement, StartExecutor, assert_close, slowed_kernel
from tests.executor.worlds import World


def test_idle_streams_cannot_starve_unary_calls(
    qwen_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    running = start_executor(
        qwen_world, grpc_workers=6, max_forward_streams=2, **placement.settings
    )
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer][:4]
    release = threading.Event()
    request = executor_pb2.ForwardStreamRequest(
        request_id=7, forward=forward_request(layer, hidden, [(4, None)])
    )

    def idle() -> Iterator[executor_pb2.ForwardStreamRequest]:
        # A slow client: one request, then nothing (a stream that never sends its first
        # request ends after --message-timeout-seconds: tests/hostile).
        yield request
        release.wait(30)

    with grpc.insecure_channel(running.app.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        held = [stub.ForwardStream(idle(), timeout=30) for _ in range(2)]
        for stream in held:
            assert next(stream).request_id == 7  # both streams are open on the server
        refused = stub.ForwardStream(idle(), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            next(refused)
        assert isinstance(info.value, grpc.Call)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(info.value.trailing_metadata() or ())["moelora-retry-after-ms"]) > 0
        # Unary calls still have threads.
        result = running.client.forward(layer, hidden, [(4, "alpha")], timeout=10)
        placement.check(result.output, qwen_world.expected(layer, [(4, "alpha")]))
        release.set()
        for stream in held:
            assert list(stream) == []
        # The slots are free again.
        answers = list(stub.ForwardStream(iter([request]), timeout=30))
        assert [a.request_id for a in answers] == [7] and answers[0].HasField("forward")


def test_client_deadline_ends_a_slow_call_on_time(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, kernel=slowed_kernel(2.0))
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer][:4]
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        running.client.forward(layer, hidden, [(4, "alpha")], timeout=0.5)
    assert time.monotonic() - start < 1.5
    # The server is fine afterwards.
    result = running.client.forward(layer, hidden, [(4, "alpha")], timeout=30)
    assert_close(result.output, qwen_world.expected(layer, [(4, "alpha")]))
