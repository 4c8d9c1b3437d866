"""Fixtures every test layer uses: free ports, server subprocesses, PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton picks its interpreter when ``triton.jit`` first runs, i.e. when ``kernels`` is first
# imported by whichever test folder comes first: decide it here, once, for every folder.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
POSTGRES_ENV = "MOELORA_TEST_POSTGRES_URL"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


class ServerProcess:
    """A service started from its console script, stopped by SIGTERM at teardown."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[object]:
    """``start_server("moelora-registry", "--listen", ...)`` runs a console script
    with the test environment; every process still running at the end is stopped."""
    started: list[ServerProcess] = []

    def start(script: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        exe = str(Path(sys.executable).parent / script)
        log_path = tmp_path / f"{script}-{len(started)}.log"
        server = ServerProcess([exe, *args], full_env, log_path)
        started.append(server)
        return server

    yield start
    for server in started:
        server.terminate()


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The PostgreSQL URL from $MOELORA_TEST_POSTGRES_URL; skips loudly without it."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        message = (
            f"PostgreSQL tests SKIPPED: set {POSTGRES_ENV} "
            "(e.g. postgresql+psycopg://root@127.0.0.1:5432/test); CI always sets it"
        )
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    return url


def wait_for(predicate: object, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Polls ``predicate()`` until true or raises TimeoutError."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s")
