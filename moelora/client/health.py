"""Asking a server's ``grpc.health.v1`` service how it is: what clients, probes and tests use
to wait for a server."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_check(channel: grpc.Channel, service: str = "", timeout: float = 5.0) -> str:
    """Status name of ``service`` on a server ("SERVING", "NOT_SERVING", ...)."""
    stub = health_pb2_grpc.HealthStub(channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def wait_until_serving(
    channel: grpc.Channel, service: str = "", timeout: float = 60.0, poll: float = 0.1
) -> None:
    """Polls health until SERVING; raises TimeoutError naming the last status."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            last = health_check(channel, service, timeout=max(0.5, poll * 5))
            if last == "SERVING":
                return
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.Call) else str(exc)
        time.sleep(poll)
    raise TimeoutError(f"server not SERVING after {timeout:.0f}s (last: {last})")
