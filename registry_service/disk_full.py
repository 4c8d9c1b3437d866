"""A full disk is the operator's to fix, not a server error: what was refused says so
(RESOURCE_EXHAUSTED), and what frees space still works.

``is_disk_full`` recognises the ways storage says it is full (ENOSPC / EDQUOT from a file write,
SQLite's "database or disk is full", PostgreSQL's disk_full / 53100), through SQLAlchemy's
wrapping. ``SpaceReserve`` keeps a small file on the registry's data volume that is given up
when a delete or a garbage collection finds the volume full (SQLite must write to delete
anything), and taken again once gc has freed space.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

from moelora.client.errors import ResourceExhausted
from moelora.client.logs import log_event

log = logging.getLogger(__name__)

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_SQLITE_FULL = "database or disk is full"
_POSTGRES_DISK_FULL = "53100"

FULL_MESSAGE = (
    "the registry's storage is full: delete versions (DeleteAdapterVersion), run "
    "GarbageCollect, or give the volume more room"
)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) says the storage is full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        if (
            _SQLITE_FULL in str(current)
            or getattr(current, "sqlstate", None) == _POSTGRES_DISK_FULL
        ):
            return True
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False


def storage_full() -> ResourceExhausted:
    return ResourceExhausted(FULL_MESSAGE)


class SpaceReserve:
    """``size`` bytes held in ``path`` for deletes and gc on a full volume."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size

    def ensure(self) -> None:
        """Takes the space again if it is free (a full volume leaves it given up)."""
        if self.path.exists() and self.path.stat().st_size >= self.size:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.path.unlink()
            if exc.errno not in _FULL_ERRNOS:
                raise
            log_event(log, "space_reserve_not_taken", logging.WARNING, path=str(self.path))

    def release(self) -> bool:
        """Gives the space up; False when there was none held."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        log_event(log, "space_reserve_released", logging.WARNING, path=str(self.path))
        return True
