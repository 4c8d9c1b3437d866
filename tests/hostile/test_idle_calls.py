"""Calls that never send their request message: a unary method called as a request stream whose
iterator blocks, so that the server waits for a message that does not come. Without a token
they are refused at once; with a token they end after --message-timeout-seconds; on health
(open to all) one client address gets a few and the rest are refused. Throughout, health
answers within a second and a caller with a token gets answers."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from moelora.client.auth import bearer_metadata
from shared.call_limits import HEALTH_CALLS_PER_PEER
from tests.hostile.conftest import MESSAGE_TIMEOUT_SECONDS, HealthWatch, Tokens, long_run
from tests.live_stack import Stack, open_fds

#: service -> the method called idly
TARGETS = {
    "executor": "/moelora.v1.Executor/GetExecutorInfo",
    "registry": "/moelora.v1.AdapterRegistry/ListBaseModels",
}
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
#: Both servers' gRPC worker threads (the default --grpc-workers / --max-workers).
WORKERS = 64


def _open_idle(
    address: str, method: str, count: int, release: threading.Event, token: str | None
) -> tuple[grpc.Channel, list[grpc.Future]]:
    """``count`` calls of ``method`` on one connection that send no message until released."""

    def never() -> Iterator[bytes]:
        release.wait(120)
        yield from ()

    channel = grpc.insecure_channel(address)
    metadata = bearer_metadata(token) if token else None
    call = channel.stream_unary(method)
    return channel, [call.future(never(), metadata=metadata, timeout=120) for _ in range(count)]


def _outcomes(calls: list[grpc.Future], timeout: float) -> Counter[str]:
    codes: Counter[str] = Counter()
    deadline = time.monotonic() + timeout
    for call in calls:
        try:
            call.result(timeout=max(0.0, deadline - time.monotonic()))
            codes["OK"] += 1
        except grpc.FutureTimeoutError:
            codes["still open"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
    return codes


def _answers(stack: Stack, service: str) -> None:
    """A caller with a token gets its answer at once."""
    start = time.monotonic()
    if service == "executor":
        with stack.executor_client() as client:
            client.get_executor_info(timeout=3)
    else:
        with stack.registry_client() as client:
            list(client.list_base_models())
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("service", ["executor", "registry"])
def test_idle_calls_without_a_token_are_refused_at_once(
    service: str,
    authed_stack: Stack,
    attacker: dict[str, str],
    request: pytest.FixtureRequest,
) -> None:
    count = 1000 if long_run(request) else 70
    method = TARGETS[service]
    address = getattr(authed_stack, f"{service}_address")
    process = getattr(authed_stack, service)
    fds_before = open_fds(process.proc.pid)
    release = threading.Event()
    with HealthWatch(address) as health:
        channel, calls = _open_idle(attacker[service], method, count, release, None)
        try:
            codes = _outcomes(calls, timeout=10)
            _answers(authed_stack, service)
        finally:
            release.set()
            channel.close()
    print(f"\n{service}: {count} idle calls without a token -> {dict(codes)}; "
          f"health worst {health.worst * 1000:.0f} ms")  # fmt: skip
    assert codes == {"UNAUTHENTICATED": count}
    health.check()
    time.sleep(0.5)
    assert open_fds(process.proc.pid) <= fds_before + 4


@pytest.mark.parametrize("service", ["executor", "registry"])
def test_idle_calls_with_a_token_end_after_the_message_timeout(
    service: str,
    authed_stack: Stack,
    attacker: dict[str, str],
    hostile_tokens: Tokens,
    request: pytest.FixtureRequest,
) -> None:
    count = 300 if long_run(request) else 70
    method = TARGETS[service]
    address = getattr(authed_stack, f"{service}_address")
    release = threading.Event()
    with HealthWatch(address) as health:
        start = time.monotonic()
        channel, calls = _open_idle(
            attacker[service], method, count, release, hostile_tokens.plain["tenant"]
        )
        try:
            time.sleep(1.0)
            codes = _outcomes(calls, timeout=15)
            ended = time.monotonic() - start
        finally:
            release.set()
            channel.close()
        _answers(authed_stack, service)
    print(f"\n{service}: {count} idle calls with a token -> {dict(codes)} within {ended:.1f} s; "
          f"health worst {health.worst * 1000:.0f} ms")  # fmt: skip
    # The server's 64 threads take 64 of them; the rest wait for a thread and get one as the
    # first end: all end at the message deadline, the last ones a deadline later. Past 4 per
    # thread (--max-concurrent-rpcs 0) they are refused at once.
    admitted = min(count, 4 * WORKERS)
    expected = {"DEADLINE_EXCEEDED": admitted, "RESOURCE_EXHAUSTED": count - admitted}
    assert codes == {code: n for code, n in expected.items() if n}
    assert ended < 1.0 + (admitted // WORKERS + 1) * MESSAGE_TIMEOUT_SECONDS + 2
    health.check()


@pytest.mark.parametrize("service", ["executor", "registry"])
def test_idle_health_calls_get_a_few_per_client_address(
    service: str, authed_stack: Stack, attacker: dict[str, str]
) -> None:
    address = getattr(authed_stack, f"{service}_address")
    release = threading.Event()
    with HealthWatch(address) as health:
        channel, calls = _open_idle(attacker[service], HEALTH_CHECK, 70, release, None)
        try:
            codes = _outcomes(calls, timeout=5)
        finally:
            release.set()
            channel.close()
    print(f"\n{service}: 70 idle health checks -> {dict(codes)}; "
          f"health worst {health.worst * 1000:.0f} ms")  # fmt: skip
    assert codes == {
        "RESOURCE_EXHAUSTED": 70 - HEALTH_CALLS_PER_PEER,
        "DEADLINE_EXCEEDED": HEALTH_CALLS_PER_PEER,
    }
    health.check()
