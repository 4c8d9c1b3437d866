"""Large requests without a token: refused on their metadata before the body is read, so the
server's memory does not move and the answer comes at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.hostile.conftest import HealthWatch, long_run
from tests.live_stack import Stack, rss_bytes

MIB = 1024 * 1024
#: (service, method, largest message the server takes by default)
TARGETS = {
    "executor": ("/moelora.v1.Executor/Forward", 500 * MIB),
    "registry": ("/moelora.v1.AdapterRegistry/UploadAdapter", 15 * MIB),
}


def _send(address: str, method: str, body: bytes, streaming: bool) -> tuple[str, float]:
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        start = time.monotonic()
        try:
            if streaming:
                channel.stream_unary(method)(iter([body]), timeout=60)
            else:
                channel.unary_unary(method)(body, timeout=60)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "?"
        return code, time.monotonic() - start


@pytest.mark.parametrize("service", ["executor", "registry"])
def test_a_large_request_without_a_token_costs_no_memory(
    service: str, authed_stack: Stack, request: pytest.FixtureRequest
) -> None:
    method, largest = TARGETS[service]
    at_once = 3
    size = largest if long_run(request) else min(largest, 160 * MIB)
    body = b"\x01" * size
    address = getattr(authed_stack, f"{service}_address")
    pid = getattr(authed_stack, service).proc.pid
    before = rss_bytes(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss_bytes(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with HealthWatch(address) as health, ThreadPoolExecutor(at_once) as pool:
        results = list(
            pool.map(lambda _: _send(address, method, body, service == "registry"), range(at_once))
        )
    done.set()
    sampler.join()
    growth = (peak[0] - before) / MIB
    slowest = max(seconds for _, seconds in results)
    print(f"\n{service}: {at_once} x {size // MIB} MiB without a token -> "
          f"{sorted({code for code, _ in results})}, slowest {slowest:.2f} s, "
          f"RSS {before / MIB:.0f} -> peak {peak[0] / MIB:.0f} MiB")  # fmt: skip
    assert {code for code, _ in results} == {"UNAUTHENTICATED"}
    assert growth < 32, f"RSS grew {growth:.0f} MiB"
    health.check()
