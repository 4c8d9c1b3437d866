"""Fault tests: S3 behind a fault-injecting proxy, servers killed with SIGKILL, damaged and
full disk caches. Short in ``make test``; ``make chaos`` runs every scenario more times."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.registry.conftest import AWS_ENV, BASE
from tests.registry.fixtures import write_base_model


@pytest.fixture(scope="session", autouse=True)
def aws_credentials() -> Iterator[None]:
    """Fake credentials for moto, for this process and the servers it starts."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in AWS_ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture
def repeats(request: pytest.FixtureRequest) -> int:
    """How often a scenario runs: once, or five times with --long."""
    return 5 if request.config.getoption("--long") else 1


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("base") / BASE)


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` at ``mount`` (created), unmounted afterwards. Skips where
    mounting is not allowed."""
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
