"""`make demo` keeps working: the demo runs start to finish and its answers match."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_demo_runs_twice_in_the_same_folder(tmp_path: Path) -> None:
    for _ in range(2):  # repeatable: the second run starts from what the first left
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "demo.run",
                "--workdir",
                str(tmp_path / "demo"),
                "--requests",
                "2",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "all answers match" in done.stdout
        assert "moelora-executor stopped (exit 0)" in done.stdout
        assert "moelora-registry stopped (exit 0)" in done.stdout
