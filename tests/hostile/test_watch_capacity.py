"""Watches for a fleet: a tenant's read token holds at most --max-watch-streams-per-token of
them, and while it does, the executor fleet's token still opens watches (many more than the
server's worker threads), each of which sees the next event; health answers throughout."""

from __future__ import annotations

import time

import grpc
import pytest

from moelora.client.auth import bearer_metadata
from moelora.client.rpc_metadata import WATCH_START_METADATA
from moelora.v1 import registry_pb2, registry_pb2_grpc
from tests.hostile.conftest import HealthWatch, Tokens, long_run
from tests.live_stack import Stack, rss_bytes

PER_TOKEN = 16  # the registry's default --max-watch-streams-per-token
MIB = 1024 * 1024


def _watches(
    stub: registry_pb2_grpc.AdapterRegistryStub, token: str, count: int
) -> list[grpc.Call]:
    metadata = bearer_metadata(token)
    return [
        stub.WatchAdapters(registry_pb2.WatchAdaptersRequest(), metadata=metadata, timeout=120)
        for _ in range(count)
    ]


def _opened(call: grpc.Call) -> str:
    """OPEN, or the code that refused the watch."""
    if WATCH_START_METADATA in dict(call.initial_metadata()):  # an open watch sends it at once
        return "OPEN"
    return str(call.code().name)  # a refused watch ended with its status, metadata empty


def test_a_tenant_cannot_take_the_fleets_watches(
    authed_stack: Stack, hostile_tokens: Tokens, request: pytest.FixtureRequest
) -> None:
    fleet_count = 1000 if long_run(request) else 100
    assert authed_stack.registry is not None
    pid = authed_stack.registry.proc.pid
    before = rss_bytes(pid)
    with (
        HealthWatch(authed_stack.registry_address) as health,
        grpc.insecure_channel(authed_stack.registry_address) as channel,
    ):
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        tenant = _watches(stub, hostile_tokens.plain["tenant"], PER_TOKEN + 4)
        tenant_codes = [_opened(call) for call in tenant]
        fleet: list[grpc.Call] = []
        for _ in range(0, fleet_count, 100):  # a fleet reconnects over a moment, not at once
            fleet += _watches(stub, hostile_tokens.plain["read"], min(100, fleet_count))
            time.sleep(0.2)
        fleet = fleet[:fleet_count]
        fleet_codes = [_opened(call) for call in fleet]
        # An event reaches every fleet watch.
        with authed_stack.registry_client() as client:
            client.set_alias("alpha", "hostile", 1)
        start = time.monotonic()
        seen = sum(next(call).name == "alpha" for call in fleet)
        delivered = time.monotonic() - start
        during = rss_bytes(pid)
        for call in tenant + fleet:
            call.cancel()
    print(f"\nwatches: tenant {tenant_codes.count('OPEN')} open, "
          f"{tenant_codes.count('RESOURCE_EXHAUSTED')} refused; fleet {fleet_codes.count('OPEN')} "
          f"of {fleet_count} open, event seen by {seen} in {delivered:.2f} s; registry RSS "
          f"{before / MIB:.0f} -> {during / MIB:.0f} MiB; health worst "
          f"{health.worst * 1000:.0f} ms")  # fmt: skip
    # Which of the tenant's watches the server took first is its choice; how many is not.
    assert sorted(tenant_codes) == ["OPEN"] * PER_TOKEN + ["RESOURCE_EXHAUSTED"] * 4
    assert fleet_codes == ["OPEN"] * fleet_count
    assert seen == fleet_count
    assert (during - before) / fleet_count < 256 * 1024  # well under a MiB per idle watch
    health.check()
