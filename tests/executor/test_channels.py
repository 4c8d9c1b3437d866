"""Direct channels: a same-host client gets a ticket over gRPC (OpenChannel), connects to the
engine's socket and sends Forward descriptors naming its registered regions, with no gRPC
call each. Answers equal Forward's; a ticket works once and only for its caller's regions; a
channel may not send bytes or admin calls, nor more requests at once than its limit."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moelora.client import AsyncExecutorClient
from moelora.client.channel import ForwardChannel
from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
)
from moelora.client.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import tensor_pb2
from tests.conftest import wait_for
from tests.executor.conftest import Running, StartExecutor, slowed_kernel
from tests.executor.worlds import TOKENS, World

F32 = tensor_pb2.DATA_TYPE_FLOAT32
RESOURCE_EXHAUSTED = 8


def test_a_channel_answers_as_forward_does(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(3, None), (TOKENS - 3, "beta")],
        [(TOKENS, None)],
    ]
    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel() as channel,
    ):
        for mix in mixes:
            output, result = channel.forward(layer, hidden, ring, mix)
            expected = client.forward(layer, hidden, mix)
            assert np.array_equal(output, expected.output)
            assert list(result.resolved_adapters) == expected.resolved_adapters
        assert channel.serving
        transports = "moelora_executor_forward_requests_by_transport_total"
        assert running.metric(transports, transport="shared_memory") == len(mixes)
        with pytest.raises(NotFound):  # the engine's error, raised as Forward's would be
            channel.forward(layer, hidden, ring, [(TOKENS, "no-such-adapter")])
        output, _ = channel.forward(layer, hidden, ring, mixes[0])  # still open, still right
        assert np.array_equal(output, client.forward(layer, hidden, mixes[0]).output)


def _client(running: Running, token: str) -> ExecutorClient:
    """A client of ``token`` that tries each call once (refusals are what the tests check)."""
    return ExecutorClient(
        running.app.address, timeout=30, retry=RetryPolicy(attempts=1), token=token
    )


def test_a_ticket_works_once_and_only_for_its_callers_regions(
    qwen_world: World, start_executor: StartExecutor, tokens: tuple[Path, dict[str, str]]
) -> None:
    path, secret = tokens
    running = start_executor(qwen_world, auth="on", auth_tokens_file=path)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()

    with (
        _client(running, secret["read"]) as owner,
        _client(running, secret["admin"]) as other,
        # Two slots: the refused channel's call ends without an answer, which retires its slot.
        owner.shared_memory(hidden.shape[1], TOKENS, slots=2, dtype="float32") as ring,
    ):
        opened = owner._stub.OpenChannel(
            ex.OpenChannelRequest(), metadata=[("authorization", f"Bearer {secret['read']}")]
        )
        with ForwardChannel(opened) as first:
            first.forward(layer, hidden, ring, [(TOKENS, "alpha")])
        with ForwardChannel(opened) as again, pytest.raises(Unavailable, match="ticket"):
            again.forward(layer, hidden, ring, [(TOKENS, "alpha")])
        with other.open_channel() as stranger, pytest.raises(NotFound, match="region"):
            stranger.forward(layer, hidden, ring, [(TOKENS, "alpha")])


def test_one_token_holds_at_most_its_share_of_channels(
    qwen_world: World, start_executor: StartExecutor, tokens: tuple[Path, dict[str, str]]
) -> None:
    """--max-channels-per-token counts a token's open channels and its unused tickets: past
    it OpenChannel is RESOURCE_EXHAUSTED for that token alone, and a channel it closes gives
    its place back."""
    path, secret = tokens
    running = start_executor(qwen_world, auth="on", auth_tokens_file=path, max_channels_per_token=2)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()

    with (
        _client(running, secret["read"]) as greedy,
        _client(running, secret["admin"]) as other,
        other.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
    ):
        first = greedy.open_channel()
        greedy._stub.OpenChannel(  # a ticket never used counts too
            ex.OpenChannelRequest(), metadata=[("authorization", f"Bearer {secret['read']}")]
        )
        with pytest.raises(ResourceExhausted, match="--max-channels-per-token"):
            greedy.open_channel()
        with other.open_channel() as theirs:  # another token is not held back
            output, _ = theirs.forward(layer, hidden, ring, [(TOKENS, "alpha")])
            assert np.array_equal(output, other.forward(layer, hidden, [(TOKENS, "alpha")]).output)
        first.close()

        def reopened() -> bool:
            try:
                greedy.open_channel().close()
            except ResourceExhausted:
                return False  # the engine has not read the close yet
            return True

        wait_for(reopened, timeout=10)


def test_a_channel_sends_no_bytes_and_makes_no_admin_calls(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    with running.client.open_channel() as channel:
        arena_ref = TensorRef("", 0, TOKENS * 64 * 4, F32, (TOKENS, 64))
        result = channel.send(
            ForwardDescriptor(1, layer, 1.0, 0.0, "", arena_ref, arena_ref, ((TOKENS, ""),))
        )
        assert result.code == 3 and "regions its caller registered" in result.message
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest())
    raw = _connect(opened)
    raw.send_json(Kind.CALL, {"id": 1, "method": "list", "args": {}})
    with pytest.raises((EOFError, OSError)):
        while True:  # a STATE first; then the engine hangs up instead of answering
            kind, _ = raw.recv()
            assert kind is Kind.STATE


def test_past_its_limit_a_channel_is_answered_resource_exhausted(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, kernel=slowed_kernel(0.3), max_channel_in_flight=2)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    with running.client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring:
        slot = ring.take(hidden)
        assert slot is not None
        request = ring.request(slot, hidden, layer, [ex.Segment(num_tokens=TOKENS)])
        refs = [
            TensorRef(t.region, t.offset, hidden.nbytes, F32, (TOKENS, hidden.shape[1]))
            for t in (request.shared_hidden_states, request.shared_output)
        ]
        raw = _connect(running.client._stub.OpenChannel(ex.OpenChannelRequest()))
        sent = 6
        for request_id in range(1, sent + 1):
            descriptor = ForwardDescriptor(
                request_id, layer, 5.0, 0.0, "", refs[0], refs[1], ((TOKENS, ""),)
            )
            raw.send(Kind.FORWARD, descriptor.encode())
        codes: list[int] = []
        while len(codes) < sent:
            kind, payload = raw.recv()
            if kind is Kind.RESULT:
                result = ForwardResult.decode(payload)
                codes.append(result.code)
                if result.code == RESOURCE_EXHAUSTED:
                    assert result.retry_after_ms > 0 and "in flight" in result.message
        assert codes.count(0) >= 2 and codes.count(RESOURCE_EXHAUSTED) >= 1, codes
        raw.close()


def test_an_unreachable_socket_is_a_clear_error() -> None:
    opened = ex.OpenChannelResponse(socket_path="/nonexistent/engine.sock", ticket="x")
    with pytest.raises(FailedPrecondition, match="channel-dir"):
        ForwardChannel(opened)


def _connect(opened: ex.OpenChannelResponse) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(opened.socket_path)
    sock.settimeout(30)
    connection = Connection(sock)
    connection.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": os.getpid()})
    return connection


def test_a_lease_holds_its_adapters_in_slots_until_its_channel_ends(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Leased adapters stay in GPU slots (a reference each) while the channel is open, and
    are let go when it closes or its client disappears; leases that would leave no slot for
    other requests are refused (a lease on a pinned adapter takes none)."""
    running = start_executor(qwen_world)  # 4 slots
    client = running.client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()

    def held() -> dict[str, int]:
        listing = client.list_loaded_adapters().adapters
        return {f"{a.name}:{a.version}": a.in_flight for a in listing if a.slot >= 0}

    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel(adapters=["alpha", "beta:1"]) as channel,
    ):
        assert channel.leased == ["alpha:1", "beta:1"]
        assert held() == {"alpha:1": 1, "beta:1": 1}
        output, _ = channel.forward(layer, hidden, ring, [(TOKENS, "alpha")])
        assert np.array_equal(output, client.forward(layer, hidden, [(TOKENS, "alpha")]).output)
        client.pin_adapter("gamma")  # 2 leased + 1 pinned: a third lease would take the last
        with pytest.raises(ResourceExhausted, match="leasing"):
            client.open_channel(adapters=["delta"])
        with client.open_channel(adapters=["gamma"]) as on_pinned:  # pinned: takes no slot
            assert on_pinned.leased == ["gamma:1"]
        assert held()["alpha:1"] == 1 and "delta:1" not in held()
    wait_for(lambda: held().get("alpha:1") == 0 and held().get("beta:1") == 0, timeout=10)

    # A client that goes away without a word lets its lease go too.
    opened = client._stub.OpenChannel(ex.OpenChannelRequest(adapters=["delta"]))
    assert list(opened.leased) == ["delta:1"]
    raw = _connect(opened)
    kind, _ = raw.recv()  # the engine's state: admitted
    assert kind is Kind.STATE
    assert held()["delta:1"] == 1
    raw.sock.close()
    wait_for(lambda: held().get("delta:1") == 0, timeout=10)
    with pytest.raises(NotFound):
        client.open_channel(adapters=["no-such-adapter"])


def test_a_channel_names_its_leased_adapters_by_handle(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """On a channel ``#i`` names the i-th adapter it leased (resolved at the lease, not per
    request): the answer is the by-name one. A handle it did not lease, and a handle outside
    a channel, are INVALID_ARGUMENT naming the segment."""
    running = start_executor(qwen_world)
    client = running.client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel(adapters=["alpha", "beta:1"]) as channel,
    ):
        output, result = channel.forward(layer, hidden, ring, [(3, "#1"), (TOKENS - 3, "#0")])
        expected = client.forward(layer, hidden, [(3, "beta:1"), (TOKENS - 3, "alpha")])
        assert np.array_equal(output, expected.output)
        assert list(result.resolved_adapters) == ["beta:1", "alpha:1"]
        for bad in ("#2", "#", "#x", "#-1", "#" + "9" * 5000):
            with pytest.raises(InvalidArgument, match=r"segments\[1\]\.adapter.*leased"):
                channel.forward(layer, hidden, ring, [(3, "#0"), (TOKENS - 3, bad)])
        output, _ = channel.forward(layer, hidden, ring, [(TOKENS, "#0")])  # still serving
        assert np.array_equal(output, client.forward(layer, hidden, [(TOKENS, "alpha")]).output)
    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel() as bare,
        pytest.raises(InvalidArgument, match="leased no adapters"),
    ):
        bare.forward(layer, hidden, ring, [(TOKENS, "#0")])
    with pytest.raises(InvalidArgument, match=r"segments\[0\]\.adapter"):
        client.forward(layer, hidden, [(TOKENS, "#0")])  # over gRPC it is no reference


def test_an_asyncio_channel_answers_overlapping_calls_each_with_its_own(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Six calls in flight on one channel at once, over a three-slot ring: each answer is its
    own input's (distinct inputs, so answers mixed up by request id would show), equal to
    Forward's with bytes."""
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    base = qwen_world.inputs[layer].numpy()
    inputs = [base * (1.0 + 0.25 * i) for i in range(6)]
    expected = [running.client.forward(layer, x, [(TOKENS, "alpha")]).output for x in inputs]

    async def calls() -> list[np.ndarray[Any, Any]]:
        async with AsyncExecutorClient(running.app.address) as client:
            ring_context = client.shared_memory(base.shape[1], TOKENS, slots=6, dtype="float32")
            async with ring_context as ring, await client.open_channel() as channel:
                answers = await asyncio.gather(
                    *(channel.forward(layer, x, ring, [(TOKENS, "alpha")]) for x in inputs)
                )
                assert channel.serving
        return [output for output, _ in answers]

    for got, want in zip(asyncio.run(calls()), expected, strict=True):
        assert np.array_equal(got, want)
