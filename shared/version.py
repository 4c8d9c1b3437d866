"""The running moe-lora-serve version and commit, as GetExecutorInfo, logs and
``moelora_build_info`` report them."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path

#: Images carry the commit they were built from (a build argument of the Dockerfiles).
COMMIT_ENV = "MOELORA_BUILD_COMMIT"


def package_version() -> str:
    """The installed distribution's version; ``0+source`` when running from a source tree
    that was not pip-installed (as on a GPU node that only has the checkout on its path)."""
    try:
        return metadata.version("moe-lora-serve")
    except metadata.PackageNotFoundError:
        return "0+source"


def source_commit() -> str:
    """The commit this code was built from: the image's ``MOELORA_BUILD_COMMIT``, else the
    checkout's HEAD when running from one, else ``unknown``."""
    commit = os.environ.get(COMMIT_ENV, "").strip()
    if commit:
        return commit
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return found.stdout.strip() or "unknown"
