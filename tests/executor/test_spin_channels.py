"""Spin channels: a direct channel whose descriptors and answers go through a block of memory
shared with the engine (``moelora.client.spin_block``), polled by the launch loop. Answers
equal Forward's whether the loop is polling or asleep (the client then rings); the engine's
block cannot be shrunk under it; a client that writes garbage, posts out of turn, breaks the
protocol or vanishes mid-request ends nothing but its own channel."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from executor_service.serving.spin_poller import SpinPoller
from executor_service.sources import LocalFolderSource
from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
    frame,
)
from moelora.client.errors import NotFound
from moelora.client.spin_block import SpinBlock
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import tensor_pb2
from tests.conftest import wait_for
from tests.executor.conftest import GatedSource, StartExecutor, slowed_kernel
from tests.executor.worlds import TOKENS, World

F32 = tensor_pb2.DATA_TYPE_FLOAT32
INVALID_ARGUMENT, RESOURCE_EXHAUSTED = 3, 8


def test_a_spin_channel_answers_as_forward_does_polled_or_woken(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, channel_spin_us=20_000)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(3, None), (TOKENS - 3, "beta")],
        [(TOKENS, None)],
    ]
    expected = [client.forward(layer, hidden, mix) for mix in mixes]
    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel(spin=True) as channel,
    ):
        assert channel.block is not None and channel.max_in_flight == 1
        gauge = "moelora_executor_channels_open"
        assert (running.metric(gauge, kind="spin"), running.metric(gauge, kind="direct")) == (1, 0)
        for _ in range(2):
            for mix, want in zip(mixes, expected, strict=True):
                output, result = channel.forward(layer, hidden, ring, mix)
                assert np.array_equal(output, want.output)
                assert list(result.resolved_adapters) == want.resolved_adapters
            # Past the spin budget the loop sleeps: the next call rings and is answered.
            wait_for(lambda: channel.block is not None and not channel.block.engine_polling, 5)
        with pytest.raises(NotFound):  # the engine's error, raised as Forward's would be
            channel.forward(layer, hidden, ring, [(TOKENS, "no-such-adapter")])
        output, _ = channel.forward(layer, hidden, ring, mixes[0])  # still open, still right
        assert np.array_equal(output, expected[0].output)
        assert channel.serving
    transports = "moelora_executor_forward_requests_by_transport_total"
    assert running.metric(transports, transport="shared_memory") == 2 * len(mixes) + 2


def test_where_the_executor_does_not_spin_the_channel_uses_its_socket(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, channel_spin_us=0)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel(spin=True) as channel,
    ):
        assert channel.block is None
        output, _ = channel.forward(layer, hidden, ring, [(TOKENS, "alpha")])
        assert np.array_equal(output, client.forward(layer, hidden, [(TOKENS, "alpha")]).output)


def test_past_the_spin_channel_limit_a_channel_uses_its_socket(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, max_spin_channels=1)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    expected = client.forward(layer, hidden, [(TOKENS, "alpha")]).output
    with client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring:
        with client.open_channel(spin=True) as first, client.open_channel(spin=True) as second:
            assert first.block is not None and second.block is None
            for channel in (first, second):
                output, _ = channel.forward(layer, hidden, ring, [(TOKENS, "alpha")])
                assert np.array_equal(output, expected)
        wait_for(lambda: running.metric("moelora_executor_channels_open", kind="spin") == 0)
        with client.open_channel(spin=True) as third:  # the first's place is free again
            assert third.block is not None


def test_a_block_opened_while_the_loop_sleeps_is_woken_for(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """The last block closes while the loop polls, other work interrupts the polling, and the
    loop then sleeps with no block open: a block opened afterwards must say the loop is not
    polling, so that its client rings."""
    running = start_executor(qwen_world, channel_spin_us=500_000)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    expected = client.forward(layer, hidden).output
    with client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring:
        with client.open_channel(spin=True) as first:
            first.forward(layer, hidden, ring)  # the loop polls for the next 0.5 s
        client.forward(layer, hidden)  # work that interrupts the polling, no block open
        time.sleep(0.1)
        with client.open_channel(spin=True, timeout=5) as second:
            assert second.block is not None
            output, _ = second.forward(layer, hidden, ring)
            assert np.array_equal(output, expected)


def test_a_spin_request_is_taken_while_other_clients_keep_the_loop_busy(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Requests of two layers never merge, so with two clients per layer the loop never
    runs dry. A CPU executor computes on the loop's own thread (no device to poll beside),
    so the loop must look at the blocks between launches too: the spin request waits a
    launch or two, not until the other clients stop (they stop after ``load_seconds``)."""
    load_seconds = 6.0
    running = start_executor(qwen_world, kernel=slowed_kernel(0.02), channel_spin_us=2_000)
    client = running.client
    first, second = qwen_world.moe_layers[:2]
    hidden = {layer: qwen_world.inputs[layer].numpy() for layer in (first, second)}
    expected = client.forward(first, hidden[first], [(TOKENS, "alpha")]).output
    stop = threading.Event()
    layers = (first, second, first, second)
    calls = [0] * len(layers)

    def load(index: int) -> None:
        while not stop.is_set():
            client.forward(layers[index], hidden[layers[index]], [(TOKENS, None)])
            calls[index] += 1

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(len(layers))]
    for thread in threads:
        thread.start()
    timer = threading.Timer(load_seconds, stop.set)
    timer.start()
    try:
        with (
            client.shared_memory(hidden[first].shape[1], TOKENS, slots=1, dtype="float32") as ring,
            client.open_channel(spin=True) as channel,
        ):
            assert channel.block is not None
            wait_for(lambda: sum(calls) >= 8, 10)  # the load runs; the spin budget is long past
            begin = time.monotonic()
            output, _ = channel.forward(first, hidden[first], ring, [(TOKENS, "alpha")])
            took = time.monotonic() - begin
            loaded = not stop.is_set()
    finally:
        stop.set()
        timer.cancel()
        for thread in threads:
            thread.join(timeout=30)
    assert np.array_equal(output, expected)
    assert loaded and took < 1.0, f"the spin request took {took:.2f} s under load"


def _admitted(opened: ex.OpenChannelResponse) -> tuple[Connection, SpinBlock, int]:
    """A raw spin channel: the connection, the block the engine sent and a descriptor of
    the block's memory."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(opened.socket_path)
    sock.settimeout(30)
    connection = Connection(sock)
    connection.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": os.getpid(), "spin": True})
    while True:
        kind, payload, fd = connection.recv_fd()
        assert kind is Kind.STATE
        if json.loads(payload).get("admitted"):
            assert fd is not None
            return connection, SpinBlock(os.dup(fd)), fd


def _answer(block: SpinBlock, request_id: int, timeout: float = 30) -> ForwardResult:
    deadline = time.monotonic() + timeout
    while (answer := block.answer(request_id)) is None:
        assert time.monotonic() < deadline, f"no answer to {request_id}"
        time.sleep(0.001)
    return ForwardResult.decode(answer)


def test_a_hostile_spin_client_ends_only_its_own_channel(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """The block is sealed (a client cannot shrink it under the engine's reads); a torn or
    garbage descriptor, a second request before the first's answer and a FORWARD frame on the
    socket are each answered or refused for that channel alone."""
    gate = threading.Event()  # adapter fetches wait here
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    with client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring:
        slot = ring.take(hidden)
        assert slot is not None
        request = ring.request(slot, hidden, layer, [ex.Segment(num_tokens=TOKENS)])
        refs = [
            TensorRef(t.region, t.offset, hidden.nbytes, F32, (TOKENS, hidden.shape[1]))
            for t in (request.shared_hidden_states, request.shared_output)
        ]

        def descriptor(request_id: int, adapter: str = "") -> bytes:
            return ForwardDescriptor(
                request_id, layer, 30.0, 0.0, "", refs[0], refs[1], ((TOKENS, adapter),)
            ).encode()

        connection, block, memfd = _admitted(client._stub.OpenChannel(ex.OpenChannelRequest()))
        with pytest.raises(PermissionError):
            os.ftruncate(memfd, 0)
        os.close(memfd)

        # A descriptor whose checksum does not match is never taken; a whole garbage one
        # is INVALID_ARGUMENT naming the descriptor.
        block._request[:4] = b"\xff\xff\xff\xff"
        block._word[1] = 4
        block._word[2] = 0  # wrong CRC
        block._seq[0] = 7
        connection.send(Kind.BELL, b"")
        time.sleep(0.2)
        assert block.answer(7) is None
        block.post(8, b"\x08" + b"\x00" * 7 + b"garbage")
        connection.send(Kind.BELL, b"")
        result = _answer(block, 8)
        assert result.code == INVALID_ARGUMENT and "descriptor" in result.message

        # Out of turn: the second is refused while the first waits for its adapter.
        block.post(9, descriptor(9, "alpha"))
        connection.send(Kind.BELL, b"")
        wait_for(lambda: sum(source.fetches.values()) > 0, timeout=10)
        block.post(10, descriptor(10))
        connection.send(Kind.BELL, b"")
        refused = _answer(block, 10)
        assert refused.code == RESOURCE_EXHAUSTED and "in flight" in refused.message
        gate.set()
        assert _answer(block, 9).code == 0
        np.testing.assert_array_equal(
            ring.output(slot, hidden), client.forward(layer, hidden, [(TOKENS, "alpha")]).output
        )

        # Bells rung in a loop: the engine serves on.
        connection.send_frames([frame(Kind.BELL, b"")] * 20_000)
        block.post(12, descriptor(12))
        connection.send(Kind.BELL, b"")
        assert _answer(block, 12).code == 0

        # A FORWARD frame on a spin channel's socket breaks the protocol: the channel ends.
        connection.send(Kind.FORWARD, descriptor(13))
        reasons = []
        with pytest.raises((EOFError, OSError)):
            while True:
                kind, payload = connection.recv()
                if kind is Kind.STATE:
                    reasons.append(json.loads(payload)["reason"])
        assert any("unexpected frame FORWARD" in r for r in reasons), reasons
        block.close()
        connection.close()
        ring.give_back(slot)
        # The engine serves on.
        with client.open_channel(spin=True) as channel:
            output, _ = channel.forward(layer, hidden, ring, [(TOKENS, "alpha")])
            assert np.array_equal(output, client.forward(layer, hidden, [(TOKENS, "alpha")]).output)


def test_a_spin_client_that_vanishes_mid_request_ends_only_its_channel(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, kernel=slowed_kernel(0.5))
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    client = running.client
    script = f"""
import os, numpy as np
from moelora.client.channel import ring_descriptor
from moelora.client.engine_wire import Kind
from moelora.client.executor import ExecutorClient
client = ExecutorClient({running.app.address!r})
hidden = np.ones(({TOKENS}, {hidden.shape[1]}), dtype=np.float32)
with client.shared_memory({hidden.shape[1]}, {TOKENS}, slots=1, dtype="float32") as ring:
    channel = client.open_channel(spin=True)
    assert channel.block is not None
    slot = ring.take(hidden)
    descriptor = ring_descriptor(ring, slot, hidden, {layer}, None, 1, 5.0)
    channel.block.post(1, descriptor.encode())
    channel._connection.send(Kind.BELL, b"")
    os._exit(0)  # mid-request: no close, no unregister
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    time.sleep(1.0)  # its request finishes; its answer has nowhere to go
    with (
        client.shared_memory(hidden.shape[1], TOKENS, slots=1, dtype="float32") as ring,
        client.open_channel(spin=True) as channel,
    ):
        output, _ = channel.forward(layer, hidden, ring, [(TOKENS, "alpha")])
        assert np.array_equal(output, client.forward(layer, hidden, [(TOKENS, "alpha")]).output)
    opened = "moelora_executor_channels_open"
    wait_for(lambda: running.metric(opened, kind="spin") == 0, timeout=10)


def test_bells_wake_the_loop_once_per_sleep() -> None:
    """A bell wakes the sleeping loop; more bells before it has looked at the blocks, or
    while it polls, wake it no more (a client ringing in a loop costs the loop nothing)."""
    poller: SpinPoller[str] = SpinPoller(0.001, lambda entry, payload, received: None)
    entry = poller.add("link")
    assert entry is not None
    try:
        assert poller.ring()
        assert not any(poller.ring() for _ in range(1000))
        assert not poller.idle(lambda: False)  # it looked (nothing posted): bells wake again
        assert poller.ring()
        entry.block.sent()
    finally:
        poller.remove(entry)
