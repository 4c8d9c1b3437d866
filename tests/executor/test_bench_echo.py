"""The benchmarks' echo floor: with ``--processes N`` the bare grpcio echo serves from N
processes on one port, every connection gets its bytes back, and its copies never outlive it
(the suite leaves no process running)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from executor_service.bench.echo_server import UNARY


def _copies(parent: int) -> list[int]:
    """Living echo processes started by ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"--parent={parent}".encode() in args and state != "Z":
            found.append(int(entry.name))
    return found


def _wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_multi_process_echo_answers_every_connection_and_stops_whole(stop: int) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "executor_service.bench.echo_server", "--processes=3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        assert _wait_for(lambda: len(_copies(server.pid)) == 2, 30), "two copies start"
        for i in range(12):  # a connection each: the kernel spreads them over the processes
            payload = bytes([i]) * (1000 + i)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert channel.unary_unary(UNARY)(payload, timeout=30) == payload
        server.send_signal(stop)
        server.wait(30)
        assert _wait_for(lambda: not _copies(server.pid), 30), "the copies outlived it"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
