"""POSIX shared memory by name, mapped into this process.

``SharedMemory`` of Python 3.11's standard library registers every segment it attaches to with
a resource tracker that unlinks it when the attaching process exits, which would destroy a
front end's arena or a client's region under its owner. So segments are opened here directly
as the files POSIX ``shm_open`` makes on Linux (``/dev/shm/NAME``), and only their creator
unlinks them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from pathlib import Path

#: Where POSIX shared-memory objects live on Linux.
SHM_ROOT = Path("/dev/shm")
#: What a segment name may be: one path component, as ``shm_open`` takes it (without "/").
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


class Segment:
    """One mapped shared-memory segment. ``create`` makes a new one of ``size`` bytes (and
    unlinks it on ``close``); otherwise an existing one is mapped whole."""

    def __init__(self, name: str, size: int = 0, *, create: bool = False) -> None:
        if not valid_name(name):
            raise ValueError(f"not a shared-memory name: {name!r}")
        self.name = name
        self._owner = create
        path = SHM_ROOT / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise ValueError(f"shared-memory segment {name!r} is empty")
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.buffer = memoryview(self._map)

    @classmethod
    def create_unique(cls, prefix: str, size: int) -> Segment:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}", size, create=True)

    def unlink(self) -> None:
        """Removes the name (the mappings stay until closed)."""
        (SHM_ROOT / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Unmaps it (views of ``buffer`` must be gone) and, if this process made it, unlinks
        it. Idempotent."""
        if self._map.closed:
            return
        self.buffer.release()
        # A view may still point into the map (a tensor in flight): then the mapping lives
        # until that view goes, and only the name goes now.
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._owner:
            self.unlink()
