"""Fixtures every test layer uses: free ports, server subprocesses, PostgreSQL."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.ports import free_port

# Triton picks its interpreter when ``triton.jit`` first runs, i.e. when ``kernels`` is first
# imported by whichever test folder comes first: decide it here, once, for every folder.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every registry a test starts (in this process or as a child) serves blobs over HTTP on a port
# of its own: the default port would collide between registries running at once.
os.environ.setdefault("MOELORA_REGISTRY_HTTP_LISTEN", "127.0.0.1:0")

REPO = Path(__file__).resolve().parent.parent
POSTGRES_ENV = "MOELORA_TEST_POSTGRES_URL"


# -- process hygiene: a test stops what it starts -------------------------------------------

_PR_SET_CHILD_SUBREAPER = 36
#: Children that outlive tests by design: Python's multiprocessing helpers.
_LONG_LIVED_CHILDREN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="run the fuzz, chaos and soak suites at full size (make fuzz / chaos / soak)",
    )
    parser.addoption(
        "--soak-calls",
        type=int,
        default=0,
        help="Forward calls per client process of the soak (default: 40, 320 with --long); more "
        "shows whether memory and descriptors level off",
    )
    parser.addoption(
        "--fuzz-uploads",
        type=int,
        default=0,
        help="mutated uploads of the fuzz suite's upload test (default: 42, 300 with --long); "
        "more shows whether the registry's memory levels off",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="full-size run: pass --long (make fuzz / chaos / soak)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Become the subreaper of everything the tests start, so that a grandchild orphaned by a
    killed child is re-parented here (and found at the end) rather than to init."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> dict[int, str]:
    """pid -> command line of this process's live (non-zombie) children."""
    found: dict[int, str] = {}
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError):
            continue
        if ppid == me and state != "Z" and not any(n in cmdline for n in _LONG_LIVED_CHILDREN):
            found[int(entry.name)] = cmdline
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run when a process a test started is still running; stops it."""
    if sys.platform != "linux":
        return
    # Two empty scans in a row: a child that exits re-parents its own children to us, and
    # a scan may see neither while that happens.
    deadline = time.monotonic() + 5.0
    empty_scans, left = 0, _children()
    while empty_scans < 2 and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        left = _children()
        empty_scans = 0 if left else empty_scans + 1
        time.sleep(0.1)
    if not left:
        return
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    listing = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in left.items())
    print(f"\nprocess hygiene: {len(left)} process(es) outlived the tests:\n{listing}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A token file (either service's format) with one token per role, each named after its
    role; and role name -> plaintext token."""
    from shared.tokens import Role, new_token_entry

    secrets, entries = {}, []
    for role in Role:
        token, entry = new_token_entry(role.name.lower(), role)
        secrets[role.name.lower()] = token
        entries.append(entry)
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": entries}))
    return path, secrets


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
