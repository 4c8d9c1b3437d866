"""The shared gRPC server, in-process on 127.0.0.1: error mapping, draining, health."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from moelora.client.errors import FailedPrecondition, InvalidArgument, NotFound
from moelora.client.health import health_check
from shared.grpc_server import GrpcServer, ServerOptions

SERVICE = "test.v1.Probe"


def _identity(data: bytes) -> bytes:
    return data


class _Probe:
    """Methods of a raw-bytes service: echo, fail with a domain error, crash, block."""

    def __init__(self) -> None:
        self.started = threading.Event()
        #: ``slow`` holds its RPC in flight until the test sets this.
        self.release = threading.Event()

    def echo(self, request: bytes, context: Any) -> bytes:
        return request

    def invalid(self, request: bytes, context: Any) -> bytes:
        raise InvalidArgument("hidden_states.shape: expected [T, 64], got [3, 65]")

    def missing(self, request: bytes, context: Any) -> bytes:
        raise NotFound("adapter 'x' not found")

    def crash(self, request: bytes, context: Any) -> bytes:
        raise RuntimeError("secret internals")

    def slow(self, request: bytes, context: Any) -> bytes:
        self.started.set()
        if not self.release.wait(10):
            raise RuntimeError("the test never released the slow RPC")
        return b"done"

    def stream_fail(self, request: bytes, context: Any) -> Iterator[bytes]:
        yield b"one"
        raise FailedPrecondition("base model mismatch")


def _handlers(probe: _Probe) -> grpc.GenericRpcHandler:
    unary = {
        name: grpc.unary_unary_rpc_method_handler(getattr(probe, name), _identity, _identity)
        for name in ("echo", "invalid", "missing", "crash", "slow")
    }
    unary["stream_fail"] = grpc.unary_stream_rpc_method_handler(
        probe.stream_fail, _identity, _identity
    )
    return grpc.method_handlers_generic_handler(SERVICE, unary)


@pytest.fixture
def served() -> Iterator[tuple[GrpcServer, grpc.Channel, _Probe]]:
    probe = _Probe()
    server = GrpcServer(
        ServerOptions(listen="127.0.0.1:0", drain_seconds=5.0),
        [SERVICE],
        lambda s: s.add_generic_rpc_handlers((_handlers(probe),)),
    )
    server.start()
    server.set_serving(True)
    channel = grpc.insecure_channel(server.address)
    yield server, channel, probe
    probe.release.set()
    channel.close()
    server.drain()


def _call(channel: grpc.Channel, method: str, payload: bytes = b"x") -> bytes:
    fn = channel.unary_unary(f"/{SERVICE}/{method}", _identity, _identity)
    return bytes(fn(payload, timeout=10))


def test_domain_errors_map_to_status_codes(served: tuple[GrpcServer, grpc.Channel, _Probe]) -> None:
    _, channel, _ = served
    assert _call(channel, "echo", b"abc") == b"abc"
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, "invalid")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden_states.shape" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, "missing")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_unexpected_exceptions_are_internal_without_leaking(
    served: tuple[GrpcServer, grpc.Channel, _Probe],
) -> None:
    _, channel, _ = served
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, "crash")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in info.value.details() and "see the server log" in info.value.details()
    assert _call(channel, "echo", b"still serving") == b"still serving"


def test_stream_errors_keep_their_code(served: tuple[GrpcServer, grpc.Channel, _Probe]) -> None:
    _, channel, _ = served
    fn = channel.unary_stream(f"/{SERVICE}/stream_fail", _identity, _identity)
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for item in fn(b"x", timeout=10):
            received.append(item)
    assert received == [b"one"]
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_drain_finishes_rpcs_in_flight_and_refuses_new_ones(
    served: tuple[GrpcServer, grpc.Channel, _Probe],
) -> None:
    server, channel, probe = served
    assert health_check(channel, SERVICE) == "SERVING"
    result: dict[str, object] = {}

    def slow_call() -> None:
        try:
            result["value"] = _call(channel, "slow")
        except grpc.RpcError as exc:
            result["error"] = exc.code()

    worker = threading.Thread(target=slow_call)
    worker.start()
    assert probe.started.wait(5)
    drainer = threading.Thread(target=server.drain)
    drainer.start()
    assert server.drain_event.wait(5)
    assert server.draining
    with pytest.raises(grpc.RpcError) as info:
        _call(channel, "echo")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.is_alive() and not server.wait(0)  # the slow RPC is still in flight
    probe.release.set()
    worker.join(10)
    drainer.join(10)
    assert result == {"value": b"done"}
    assert server.wait(0)
