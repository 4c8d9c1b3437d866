"""The engine's channel socket attacked as a local process could: garbage, a frame too long to
buffer, a connection that never introduces itself, a stolen (used) ticket, malformed
descriptors. Each attack ends the attacker's connection or gets an error answer; the executor
serves a Forward right after every one, and no attack leaves an error-level log line."""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pytest

from executor_service.serving.engine_host import CHANNEL_MAX_FRAME, HELLO_TIMEOUT_SECONDS
from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
)
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import tensor_pb2
from tests.executor.conftest import Running, StartExecutor
from tests.executor.worlds import TOKENS, World

INVALID_ARGUMENT = 3


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(HELLO_TIMEOUT_SECONDS + 5)
    return sock


def _closed_by_engine(sock: socket.socket) -> bool:
    """Whether the engine hangs up (after at most a STATE frame), within the timeout."""
    connection = Connection(sock)
    try:
        while True:
            kind, _ = connection.recv()
            if kind is not Kind.STATE:
                return False
    except (EOFError, ConnectionResetError):
        return True
    finally:
        sock.close()


def _still_serves(running: Running, world: World) -> None:
    layer = world.moe_layers[0]
    hidden = world.inputs[layer].numpy()
    answer = running.client.forward(layer, hidden, [(TOKENS, "alpha")])
    assert answer.output.shape == hidden.shape and np.isfinite(answer.output).all()


@pytest.fixture
def running(qwen_world: World, start_executor: StartExecutor) -> Running:
    return start_executor(qwen_world)


def test_garbage_and_oversized_frames_end_only_that_connection(
    qwen_world: World, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest())
    attacks = {
        "unknown kind": struct.pack("<IB", 4, 99) + b"junk",
        "too long to buffer": struct.pack("<IB", CHANNEL_MAX_FRAME + 1, int(Kind.HELLO)),
        "forward before its ticket": struct.pack("<IB", 8, int(Kind.FORWARD)) + b"\0" * 8,
        "hello that is not JSON": struct.pack("<IB", 3, int(Kind.HELLO)) + b"{{{",
    }
    for name, frame in attacks.items():
        sock = _raw(opened.socket_path)
        sock.sendall(frame)
        start = time.monotonic()
        assert _closed_by_engine(sock), name
        assert time.monotonic() - start < 2.0, f"{name}: the engine read on instead of hanging up"
        _still_serves(running, qwen_world)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_connection_that_never_says_hello_is_dropped(qwen_world: World, running: Running) -> None:
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest())
    sock = _raw(opened.socket_path)
    start = time.monotonic()
    assert _closed_by_engine(sock)
    assert HELLO_TIMEOUT_SECONDS - 0.5 <= time.monotonic() - start <= HELLO_TIMEOUT_SECONDS + 3
    _still_serves(running, qwen_world)


def test_malformed_descriptors_are_answered_invalid_argument(
    qwen_world: World, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest())
    sock = _raw(opened.socket_path)
    connection = Connection(sock)
    connection.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": os.getpid()})
    layer = qwen_world.moe_layers[0]
    whole = ForwardDescriptor(7, layer, 1.0, 0.0, "", _ref(0), _ref(4096), ((TOKENS, ""),))
    truncated = whole.encode()[:30]
    negative = ForwardDescriptor(
        8, layer, 1.0, 0.0, "", _ref(0, (-TOKENS, 64)), _ref(4096), ((TOKENS, ""),)
    ).encode()
    for request_id, payload in ((7, truncated), (8, negative)):
        connection.send(Kind.FORWARD, payload)
        while True:
            kind, answer = connection.recv()
            if kind is Kind.RESULT:
                break
        result = ForwardResult.decode(answer)
        assert (result.request_id, result.code) == (request_id, INVALID_ARGUMENT), result
        assert "descriptor" in result.message or "shape" in result.message
    sock.close()
    _still_serves(running, qwen_world)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_used_ticket_cannot_be_used_again(qwen_world: World, running: Running) -> None:
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest())
    first = _raw(opened.socket_path)
    owner = Connection(first)
    owner.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": 1})
    # A round trip: once a descriptor is answered, the ticket has been taken (frames of one
    # connection are read in order).
    layer = qwen_world.moe_layers[0]
    probe = ForwardDescriptor(1, layer, 1.0, 0.0, "", _ref(0), _ref(4096), ((TOKENS, ""),))
    owner.send(Kind.FORWARD, probe.encode())
    while (answer := owner.recv())[0] is not Kind.RESULT:
        pass
    assert ForwardResult.decode(answer[1]).code == INVALID_ARGUMENT  # admitted: no bytes, though
    thief = _raw(opened.socket_path)
    Connection(thief).send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": 2})
    assert _closed_by_engine(thief)
    first.close()
    _still_serves(running, qwen_world)


def _ref(offset: int, shape: tuple[int, ...] = (TOKENS, 64)) -> TensorRef:
    """A reference into no registered region (the checks this file attacks come first)."""
    return TensorRef("", offset, TOKENS * 64 * 4, tensor_pb2.DATA_TYPE_FLOAT32, shape)
