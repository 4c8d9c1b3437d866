"""Fixtures every test layer uses: free ports, server subprocesses, PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server in its HTTP mode on 127.0.0.1 (a real S3 protocol peer, no mocks)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def pg_schema_url(postgres_url: str) -> Iterator[str]:
    """A PostgreSQL URL whose tables live in a fresh schema, dropped afterwards (the CI
    database outlives every run)."""
    from sqlalchemy import create_engine, make_url, text

    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def wait_for(predicate: object, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Polls ``predicate()`` until true or raises TimeoutError."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s")
