"""Per-piece SHA-256s of a file: the file cut into pieces of a fixed size (the last one may be
shorter), each hashed on its own, so that a downloader can check ranges in parallel as they
arrive instead of hashing the whole file in order (AdapterFile.part_sha256)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from moelora.client.errors import DataLoss

MIB = 1024 * 1024
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Pieces:
    """The sha256 of consecutive ``size``-byte pieces of a file (the last may be shorter), as a
    downloader checks them."""

    size: int
    sha256: tuple[str, ...]

    def count(self, file_size: int) -> int:
        """How many pieces a file of ``file_size`` bytes has."""
        return -(-file_size // self.size)

    def span(self, index: int, file_size: int) -> tuple[int, int]:
        return index * self.size, min(file_size, (index + 1) * self.size)

    def digest(self, data: memoryview, index: int) -> str:
        """The sha256 of piece ``index`` of the whole file's bytes ``data`` (hashlib releases
        the GIL: threads may hash pieces in parallel)."""
        begin, end = self.span(index, len(data))
        return hashlib.sha256(data[begin:end]).hexdigest()

    def check(self, file_size: int, label: str) -> None:
        """Raises DataLoss unless these pieces can describe a file of ``file_size`` bytes."""
        expected = self.count(file_size) if self.size > 0 else -1
        if len(self.sha256) != expected or not all(map(_SHA256_HEX.fullmatch, self.sha256)):
            raise DataLoss(
                f"{label}: the registry lists {len(self.sha256)} piece digests of "
                f"{self.size} bytes for {file_size} bytes; expected {max(expected, 0)} "
                "lower-case hex sha256 values"
            )


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

    def update(self, data: bytes | memoryview) -> list[str]:
        """Hashes the next bytes; returns the digests of the pieces they completed."""
        view = memoryview(data).cast("B")
        completed = []
        while view:
            take = min(len(view), self.part_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.part_size:
                completed.append(self._close_piece())
        return completed

    def _close_piece(self) -> str:
        digest = self._current.hexdigest()
        self._done.append(digest)
        self._current = hashlib.sha256()
        self._filled = 0
        return digest

    def finish(self) -> tuple[str, ...]:
        """Every piece's digest, the short last one included; ceil(bytes / part_size) values."""
        if self._filled:
            self._close_piece()
        return tuple(self._done)
