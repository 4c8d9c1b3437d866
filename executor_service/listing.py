"""What the registry lists of a version's files, and the check of a file's bytes against it.

A file is known by its size and sha256, and, where the registry recorded them at upload, by
the sha256 of its fixed-size pieces (``Pieces``): those can be checked by several threads at
once and in any order, which is what lets a download check parts as they arrive
(``arriving.py``) and the disk cache check an entry after a restart at the speed of the cores
rather than of one.
"""

from __future__ import annotations

import hashlib
import mmap
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shared.errors import DataLoss

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Pieces:
    """The sha256 of consecutive ``size``-byte pieces of a file (the last may be shorter)."""

    size: int
    sha256: tuple[str, ...]

    def span(self, index: int, file_size: int) -> tuple[int, int]:
        return index * self.size, min(file_size, (index + 1) * self.size)

    def check(self, file_size: int, label: str) -> None:
        """Raises DataLoss unless these pieces can describe a file of ``file_size`` bytes."""
        expected = -(-file_size // self.size) if self.size > 0 else -1
        if len(self.sha256) != expected or not all(map(_SHA256_HEX.fullmatch, self.sha256)):
            raise DataLoss(
                f"{label}: the registry lists {len(self.sha256)} piece digests of "
                f"{self.size} bytes for {file_size} bytes; expected {max(expected, 0)} "
                "lower-case hex sha256 values"
            )


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
            if -(-size // pieces.size) != len(pieces.sha256):
                return False
            if size == 0:
                return True
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return False
    with mapped, memoryview(mapped) as view:

        def matches(index: int) -> bool:
            begin, end = pieces.span(index, size)
            return hashlib.sha256(view[begin:end]).hexdigest() == pieces.sha256[index]

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="piece-check") as pool:
            return all(pool.map(matches, range(len(pieces.sha256))))
