"""What the registry lists of a version's files, and the check of a file's bytes against it.

A file is known by its size and sha256, and, where the registry recorded them at upload, by the
sha256 of its fixed-size pieces (``moelora.client.part_digests.Pieces``): those can be checked by
several threads at once and in any order, which is what lets a download check parts as they arrive
(``arriving.py``) and the disk cache check an entry after a restart at the speed of the cores rather
than of one.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moelora.client.part_digests import Pieces


@dataclass(frozen=True)
class RemoteFile:
    """A file of the version: its name, size and the sha256 it must have (and its pieces'
    sha256, where the registry recorded them)."""

    path: str
    size: int
    sha256: str
    pieces: Pieces | None = None


def pieces_match(path: Path, pieces: Pieces, threads: int) -> bool:
    """Whether the file at ``path`` has exactly these pieces, hashed by ``threads`` threads
    (hashlib releases the GIL). False when it cannot be read or has another size."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            if pieces.count(size) != len(pieces.sha256):
                return False
            if size == 0:
                return True
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return False
    with mapped, memoryview(mapped) as view:

        def matches(index: int) -> bool:
            return pieces.digest(view, index) == pieces.sha256[index]

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="piece-check") as pool:
            return all(pool.map(matches, range(len(pieces.sha256))))
