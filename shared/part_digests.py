"""Per-piece SHA-256s of a file: the file cut into pieces of a fixed size (the last one may be
shorter), each hashed on its own, so that a downloader can check ranges in parallel as they
arrive instead of hashing the whole file in order (AdapterFile.part_sha256)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class FileDigests:
    """A file's whole sha256 and its pieces' (``part_size_bytes`` 0 and no pieces: not asked
    for), all lower-case hex."""

    sha256: str
    part_size_bytes: int
    part_sha256: tuple[str, ...]


class PartHasher:
    """Hashes bytes fed in order, one sha256 per ``part_size`` bytes. Chunks may straddle
    piece boundaries: they are split with memoryview slices, never copied."""

    def __init__(self, part_size: int) -> None:
        if part_size <= 0:
            raise ValueError(f"part_size: {part_size} is not positive")
        self.part_size = part_size
        self._current = hashlib.sha256()
        self._filled = 0
        self._done: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.part_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.part_size:
                self._close_piece()

    def _close_piece(self) -> None:
        self._done.append(self._current.hexdigest())
        self._current = hashlib.sha256()
        self._filled = 0

    def finish(self) -> tuple[str, ...]:
        """Every piece's digest, the short last one included; ceil(bytes / part_size) values."""
        if self._filled:
            self._close_piece()
        return tuple(self._done)
