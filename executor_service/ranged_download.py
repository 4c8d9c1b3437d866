"""Where an adapter version's files are downloaded as byte ranges by parallel workers.

The files are cut into parts, taken in file order by ``streams`` workers (so the file fills
from the front and the packer behind it rarely waits), each part fetched as one ranged read
(the registry's DownloadAdapter with a range, or an HTTP Range GET on a presigned URL) into
where it belongs in an ``ArrivingFile``, which checks it as it grows (by the registry's piece
digests in the workers as the bytes pass, parts being whole pieces, or in order by one hasher):
a ``Part`` takes bytes in order, objects the registry's stream delivered (``write``) or what a
socket received straight into the file (``receive`` + ``received``). The first failure of any
part stops the others and is what every waiter gets.

This is what s3transfer and hf_transfer do for one large object: parallel ranged GETs into a
preallocated file; here the bytes are also usable (for packing) before the whole file is in.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from executor_service.arriving import ArrivingFile, Inflow
from executor_service.listing import RemoteFile
from executor_service.loader import lower_priority

_MIB = 1 << 20
#: Parts are at least this big (fewer requests), at most ``_MAX_PART`` (finer interleaving).
_MIN_PART = 8 * _MIB
_MAX_PART = 64 * _MIB


class Part:
    """Bytes ``offset`` to ``offset + length`` of file ``index``, and where they go. ``write``
    and ``received`` return False once the download stopped: the reader should return then."""

    def __init__(
        self, index: int, offset: int, length: int, inflow: Inflow, stopped: threading.Event
    ) -> None:
        self.index = index
        self.offset = offset
        self.length = length
        self._inflow = inflow
        self._stopped = stopped

    def write(self, at: int, data: bytes | memoryview) -> bool:
        """Stores the part's next bytes, for ``at``, that came as an object (a copy)."""
        return not self._stopped.is_set() and self._inflow.write(at, data)

    def receive(self, n: int) -> memoryview:
        """Where the part's next ``n`` bytes go in the file, to receive them into."""
        return self._inflow.receive(n)

    def received(self, n: int) -> bool:
        """The next ``n`` bytes landed where ``receive`` said."""
        return not self._stopped.is_set() and self._inflow.received(n)


#: Fetches a part (see ``Part``); raises what went wrong.
RangeReader = Callable[[Part], None]


def _parts(files: Sequence[RemoteFile], streams: int) -> deque[tuple[int, int, int]]:
    """(file index, offset, length) parts, file by file; about 4 per stream for the largest
    file, so that workers finish close together; whole pieces of files that have them, so
    that the worker completing a part can check it."""
    largest = max((f.size for f in files), default=0)
    target = min(_MAX_PART, max(_MIN_PART, largest // (4 * streams)))
    parts: deque[tuple[int, int, int]] = deque()
    for index, f in enumerate(files):
        grain = f.pieces.size if f.pieces is not None else _MIB
        part = max(grain, target // grain * grain)
        parts.extend((index, at, min(part, f.size - at)) for at in range(0, f.size, part))
    return parts


class RangedDownload:
    """Downloads ``files`` into ``folder`` with ``streams`` workers, started at once."""

    def __init__(
        self,
        folder: Path,
        files: Sequence[RemoteFile],
        read: RangeReader,
        streams: int,
        label: str,
        nice: int,
    ) -> None:
        self._read = read
        self._nice = nice
        self._stopped = threading.Event()
        self._files: list[ArrivingFile] = []
        try:
            for f in files:
                self._files.append(
                    ArrivingFile(
                        folder / f.path, f.size, f.sha256, f"{label} {f.path}", nice, f.pieces
                    )
                )
        except BaseException:
            self.close()
            raise
        self._by_path = {f.path: arriving for f, arriving in zip(files, self._files, strict=True)}
        self._lock = threading.Lock()
        self._parts = _parts(files, streams)
        for n in range(max(1, min(streams, len(self._parts)))):
            threading.Thread(target=self._work, name=f"download-{n}", daemon=True).start()

    def file(self, path: str) -> ArrivingFile:
        return self._by_path[path]

    def wait_verified(self) -> None:
        """Blocks until every file arrived and matched its sha256; raises the first failure."""
        for arriving in self._files:
            arriving.wait_verified()

    def close(self) -> None:
        """Stops the workers (one still receiving drops what it gets) and closes the files."""
        self._stopped.set()
        for arriving in self._files:
            arriving.close()

    def _take(self) -> tuple[int, int, int] | None:
        with self._lock:
            return self._parts.popleft() if self._parts and not self._stopped.is_set() else None

    def _work(self) -> None:
        lower_priority(self._nice)
        while (taken := self._take()) is not None:
            index, offset, length = taken
            file = self._files[index]
            try:
                self._read(Part(index, offset, length, file.inflow(offset), self._stopped))
            except BaseException as exc:  # every waiter gets it
                self._stopped.set()
                for each in self._files:
                    each.fail(exc)
                return
