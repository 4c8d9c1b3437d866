"""The blob HTTP server against clients that hold connections, trickle bytes, connect all at
once or send odd requests: connections past --http-max-connections get 503 at once and cost the
registry nothing lasting, a trickled request head is cut at --http-timeout-seconds however
steadily it trickles, a fleet connecting together is answered at once, and odd requests get
4xx with short bodies, with the grant never written to the log."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.executor.worlds import World
from tests.hostile.conftest import HealthWatch, long_run
from tests.live_stack import BASE, Stack, open_fds

MAX_CONNECTIONS = 64
TIMEOUT_SECONDS = 2.0


@pytest.fixture(scope="module")
def blob_stack(hostile_world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A registry serving blob URLs (auth off: the URLs are the grant under test)."""
    flags = (
        "--http-max-connections", str(MAX_CONNECTIONS),
        "--http-timeout-seconds", str(TIMEOUT_SECONDS),
    )  # fmt: skip
    stack = Stack(hostile_world, tmp_path_factory.mktemp("blobs"), registry_flags=flags)
    try:
        stack.start(["alpha"], executor=False)
        yield stack
    finally:
        stack.stop()


def _url(stack: Stack) -> str:
    with stack.registry_client() as client:
        urls = client.download_urls("alpha:1")
    return next(f.url for f in urls.files if f.file.path == "adapter_model.safetensors")


def _address(url: str) -> tuple[str, int]:
    netloc = urlsplit(url).netloc
    host, _, port = netloc.rpartition(":")
    return host, int(port)


def _get(address: tuple[str, int], target: str, headers: str = "") -> tuple[int, bytes]:
    with socket.create_connection(address, timeout=10) as sock:
        request = f"GET {target} HTTP/1.1\r\nHost: r\r\n{headers}Connection: close\r\n\r\n"
        sock.sendall(request.encode("utf-8"))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_held_connections_are_capped_and_cost_nothing_lasting(
    blob_stack: Stack, request: pytest.FixtureRequest
) -> None:
    count = 1000 if long_run(request) else 300
    url = _url(blob_stack)
    address = _address(url)
    assert blob_stack.registry is not None
    pid = blob_stack.registry.proc.pid
    before = open_fds(pid)
    held: list[socket.socket] = []
    refused = 0
    with HealthWatch(blob_stack.registry_address) as health:
        try:
            for _ in range(count):
                held.append(socket.create_connection(address, timeout=10))
            time.sleep(0.5)
            during = open_fds(pid)
            for sock in held[MAX_CONNECTIONS:]:
                sock.settimeout(5)
                refused += sock.recv(64).startswith(b"HTTP/1.1 503")
            # The server still answers a new client once the held ones let go.
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.5)
        status, _ = _get(address, urlsplit(url).path + "?" + urlsplit(url).query)
        with blob_stack.registry_client() as client:
            client.upload(blob_stack.world.adapter_dir / "alpha", "after-flood", BASE)
    after = open_fds(pid)
    worst = health.worst * 1000
    print(f"\nblob HTTP: {count} held connections -> {refused} refused 503, registry fds "
          f"{before} -> {during} -> {after}; health worst {worst:.0f} ms")  # fmt: skip
    assert refused == count - MAX_CONNECTIONS
    assert during <= before + MAX_CONNECTIONS + 8
    assert after <= before + 4
    assert status == 200
    health.check()


def test_a_trickled_head_is_cut_at_the_deadline(blob_stack: Stack) -> None:
    address = _address(_url(blob_stack))
    with socket.create_connection(address, timeout=10) as sock:
        start = time.monotonic()
        sent = 0
        closed_after = None
        for byte in b"GET /v1/blobs/sha256/" + b"a" * 200:
            try:
                sock.sendall(bytes([byte]))
                sent += 1
            except OSError:
                closed_after = time.monotonic() - start
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                pass
    print(f"\nblob HTTP: a 1-byte trickle was cut after {closed_after} s ({sent} bytes)")
    assert closed_after is not None and closed_after < TIMEOUT_SECONDS + 1.5


def test_a_fleet_connecting_together_is_answered_at_once(blob_stack: Stack) -> None:
    url = _url(blob_stack)
    address = _address(url)
    target = urlsplit(url).path + "?" + urlsplit(url).query

    def one(_: int) -> float:
        start = time.monotonic()
        status, _body = _get(address, target, "Range: bytes=0-1023\r\n")
        assert status == 206
        return time.monotonic() - start

    with ThreadPoolExecutor(MAX_CONNECTIONS) as pool:
        seconds = list(pool.map(one, range(MAX_CONNECTIONS)))
    p50, worst = statistics.median(seconds) * 1000, max(seconds) * 1000
    print(f"\nblob HTTP: {MAX_CONNECTIONS} connecting together: p50 {p50:.0f} ms, "
          f"max {worst:.0f} ms")  # fmt: skip
    assert max(seconds) < 2


def test_odd_requests_get_short_4xx_and_no_grant_is_logged(blob_stack: Stack) -> None:
    url = _url(blob_stack)
    address = _address(url)
    parts = urlsplit(url)
    signature = parts.query.split("signature=")[1]
    target = f"{parts.path}?{parts.query}"
    answers = {
        "superscript expires": _get(address, f"{parts.path}?expires=%C2%B2&signature={signature}"),
        "long range": _get(address, target, f"Range: bytes={'9' * 5000}-\r\n"),
        "unicode digits": _get(address, target, "Range: bytes=\u0663-\r\n"),
        "no grant": _get(address, parts.path),
    }
    codes = {name: status for name, (status, _) in answers.items()}
    print(f"\nblob HTTP odd requests: {codes}")
    assert codes == {
        "superscript expires": 403, "long range": 416, "unicode digits": 416, "no grant": 403,
    }  # fmt: skip
    assert all(len(body) < 300 for _, body in answers.values())
    assert blob_stack.registry is not None
    assert signature not in Path(blob_stack.registry.log_path).read_text()
