"""Where a file downloaded in parallel parts is assembled, checked and read while it arrives.

``ArrivingFile`` is a file of known size and sha256, allocated up front (so a full disk fails
before any byte is fetched) and filled by part workers in any order, each filling its part
front to back through an ``Inflow``. It records which byte ranges have arrived, so that a
reader (the packer) can wait for the ranges it needs and use them while the rest is still on
its way. When the registry recorded the sha256 of the file's fixed-size pieces (``Pieces``),
each worker hashes its part's pieces step by step as the bytes land, while they are still in
the CPU's cache (parts are whole pieces), so the check runs on as many cores as there are
workers and a bad piece is named as it fails. Without pieces one thread of its own hashes the
file in order as its contiguous prefix grows (through the memory map: no copy). ``wait_verified``
says whether the whole file matched: a reader may look at bytes early, but nothing built from
them may be published before that.

Parts arrive two ways. A socket receives straight into the file's shared memory map
(``Inflow.receive`` + ``received``: the one copy is the kernel's), each step's pages mapped
ahead by one ``madvise(MADV_POPULATE_WRITE)`` with the GIL released: left to fault in as the
bytes land (some 27 000 faults for a 1.26 GB adapter on the 6.18 kernels here), Forward beside
a cold load lost 1.7 times as much time (docs/decisions/0005-download-in-the-serving-process.md).
Bytes that came as objects (the registry's gRPC stream) are written with ``pwrite``
(``Inflow.write``). Writing every part with ``pwrite`` from a buffer of the worker's instead
serialised the workers on the file's inode lock: 2.5-4.4 GB/s for 8 threads on an H200 host,
against 10-12 through the map.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys
import threading
from pathlib import Path

from executor_service.loader import lower_priority
from moelora.client.errors import DataLoss
from moelora.client.part_digests import PartHasher, Pieces

#: Bytes hashed per step by the whole-file hasher, so that it notices a cancel within
#: milliseconds.
_HASH_STEP = 8 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = mmap.PAGESIZE
#: madvise through ctypes: a foreign call releases the GIL (mmap.madvise holds it).
_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None


class ArrivingFile:
    """One file being downloaded into ``path`` (see the module doc). Thread-safe."""

    def __init__(
        self,
        path: Path,
        size: int,
        sha256: str,
        label: str,
        nice: int,
        pieces: Pieces | None = None,
    ) -> None:
        """``pieces``: the file's piece digests, checked by the workers as each piece passes;
        without them the whole file is hashed in order."""
        if pieces is not None:
            pieces.check(size, label)
        self.path = path
        self.size = size
        self.sha256 = sha256
        self.label = label
        self._nice = nice
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if size:
                os.posix_fallocate(self._fd, 0, size)  # ENOSPC now, not mid-download
            self._map = mmap.mmap(self._fd, size, access=mmap.ACCESS_WRITE) if size else None
        except BaseException:
            os.close(self._fd)
            raise
        self._address = 0
        if self._map is not None:
            exported = ctypes.c_char.from_buffer(self._map)
            self._address = ctypes.addressof(exported)
            del exported  # the map is never closed, only dropped: its address stays valid
        self._changed = threading.Condition()
        #: Disjoint arrived ranges [begin, end), sorted; few: each worker fills its part in order.
        self._arrived: list[tuple[int, int]] = []
        self._error: BaseException | None = None
        self._verified = False
        self._closed = False
        self._writing = 0
        #: Checked by pieces (when there are any: an empty file has none) or by one hasher.
        self.pieces = pieces if pieces is not None and size else None
        self._unverified = len(self.pieces.sha256) if self.pieces else 0
        self._hasher: threading.Thread | None = None
        if self.pieces is None:
            self._hasher = threading.Thread(target=self._hash, name="arriving-hash", daemon=True)
            self._hasher.start()

    # -- the workers' side -----------------------------------------------------------------

    def inflow(self, offset: int) -> Inflow:
        """A writer of this file's bytes from ``offset`` on, in order (one per part)."""
        return Inflow(self, offset)

    def fail(self, error: BaseException) -> None:
        """The download failed: every waiter gets ``error`` (the first one reported)."""
        with self._changed:
            if self._error is None:
                self._error = error
            self._changed.notify_all()

    def store(self, offset: int, data: memoryview) -> bool:
        """Stores bytes that arrived for ``offset`` (``Inflow`` calls it, having hashed them);
        False, and nothing stored, once the file is closed (a worker that was still receiving
        when the load was abandoned)."""
        with self._changed:
            if self._closed:
                return False
            self._writing += 1  # close() waits for writes in progress: the fd stays theirs
        written_all = False
        try:
            view, at = data, offset
            while view:  # pwrite may write less than asked
                written = os.pwrite(self._fd, view, at)
                view, at = view[written:], at + written
            written_all = True
        finally:
            with self._changed:
                self._writing -= 1
                stored = written_all and not self._closed
                if stored:
                    self._add(offset, offset + len(data))
                self._changed.notify_all()
        return stored

    def landed(self, begin: int, end: int) -> bool:
        """Bytes ``begin`` to ``end`` landed in the map (``Inflow`` calls it, having hashed
        them); False once the file is closed."""
        with self._changed:
            if self._closed:
                return False
            self._add(begin, end)
            self._changed.notify_all()
        return True

    def populate(self, begin: int, end: int) -> None:
        """Maps the pages of bytes ``begin`` to ``end`` for writing, in one call (best effort:
        where the kernel declines, they fault in as written)."""
        if _madvise is None or begin >= end:
            return
        start = (self._address + begin) // _PAGE * _PAGE
        _madvise(
            ctypes.c_void_p(start),
            ctypes.c_size_t(self._address + end - start),
            ctypes.c_int(_MADV_POPULATE_WRITE),
        )

    def piece_hashed(self, index: int, actual: str) -> None:
        """Records the sha256 of piece ``index`` as ``Inflow`` found it, once it is stored."""
        assert self.pieces is not None
        expected = self.pieces.sha256[index]
        with self._changed:
            if actual != expected:
                if self._error is None:
                    begin, end = self.pieces.span(index, self.size)
                    self._error = DataLoss(
                        f"{self.label}: downloaded bytes {begin}-{end} (piece {index + 1} "
                        f"of {len(self.pieces.sha256)}) have sha256 {actual}, expected {expected}"
                    )
            else:
                self._unverified -= 1
                self._verified = self._unverified == 0
            self._changed.notify_all()

    # -- the reader's side -----------------------------------------------------------------

    def view(self) -> memoryview:
        """The whole file's bytes, arrived or not (wait before reading a range)."""
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def wait(self, begin: int, end: int) -> None:
        """Blocks until bytes ``begin`` to ``end`` (clipped to the file) arrived; raises the
        download's error if it failed."""
        end = min(end, self.size)
        with self._changed:
            while not self._has(begin, end):
                self._raise_if_failed()
                self._changed.wait()

    def wait_verified(self) -> None:
        """Blocks until the whole file arrived and matched its sha256; raises DataLoss when it
        did not, or the download's error."""
        with self._changed:
            while not self._verified:
                self._raise_if_failed()
                self._changed.wait()

    def close(self) -> None:
        """Stops the hasher, drops later writes and closes the file once the writes in
        progress finished (a worker still waiting for bytes is not waited for). The memory map
        lives on while views of it do (packed tensors never do: they are copies)."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
            while self._writing:
                self._changed.wait()
        if self._hasher is not None:
            self._hasher.join()
        os.close(self._fd)

    # -- internals -------------------------------------------------------------------------

    def _hash(self) -> None:
        lower_priority(self._nice)
        digest = hashlib.sha256()
        view = self.view()
        done = 0
        while done < self.size:
            with self._changed:
                while not self._closed and self._error is None and self._prefix() <= done:
                    self._changed.wait()
                if self._closed or self._error is not None:
                    return
                ready = self._prefix()
            while done < ready:
                step = min(ready, done + _HASH_STEP)
                digest.update(view[done:step])  # releases the GIL
                done = step
        with self._changed:
            if digest.hexdigest() == self.sha256:
                self._verified = True
            elif self._error is None:
                self._error = DataLoss(
                    f"{self.label}: the downloaded bytes have sha256 {digest.hexdigest()}, "
                    f"expected {self.sha256}"
                )
            self._changed.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError(f"{self.label}: the download was abandoned")

    def _prefix(self) -> int:
        """How far the file has arrived from byte 0 without a gap (lock held)."""
        return self._arrived[0][1] if self._arrived and self._arrived[0][0] == 0 else 0

    def _has(self, begin: int, end: int) -> bool:
        return begin >= end or any(b <= begin and end <= e for b, e in self._arrived)

    def _add(self, begin: int, end: int) -> None:
        """Records an arrival (lock held)."""
        merged: list[tuple[int, int]] = []
        for b, e in sorted([*self._arrived, (begin, end)]):
            if merged and b <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((b, e))
        self._arrived = merged


class Inflow:
    """A part's bytes put into an ``ArrivingFile`` front to back from ``offset``, written
    (``write``) or received in place (``receive`` + ``received``): each piece of a file that
    has pieces is hashed step by step as its bytes come and checked once all are in (a part
    starts on a piece's boundary). Used by one thread."""

    def __init__(self, file: ArrivingFile, offset: int) -> None:
        pieces = file.pieces
        if pieces is not None and offset % pieces.size:
            raise ValueError(f"{file.label}: a part at {offset} starts inside a piece")
        self._file = file
        self._next = offset
        #: The part's pieces, hashed in order from the first (index ``offset // size``).
        self._pieces = PartHasher(pieces.size) if pieces is not None else None
        self._first = offset // pieces.size if pieces is not None else 0
        self._reported = 0

    def write(self, at: int, data: bytes | memoryview) -> bool:
        """Hashes and stores bytes that came as an object for ``at``, which must follow the
        last ones; False once the file is closed (the worker should stop)."""
        self._check_next(at)
        view = memoryview(data).cast("B")
        hashed = self._hash(at, view)
        if not self._file.store(at, view):
            return False
        self._advance(view, hashed)
        return True

    def receive(self, n: int) -> memoryview:
        """Where the next ``n`` bytes go: the file's own memory, its pages mapped ahead;
        report them with ``received``. Landing after ``close`` is harmless (the map outlives
        the file) and recorded nowhere."""
        begin = self._next
        end = min(begin + n, self._file.size)
        self._file.populate(begin, end)
        return self._file.view()[begin:end]

    def received(self, n: int) -> bool:
        """The next ``n`` bytes landed where ``receive`` said: hashes and records them; False
        once the file is closed (the worker should stop)."""
        view = self._file.view()[self._next : self._next + n]
        hashed = self._hash(self._next, view)
        if not self._file.landed(self._next, self._next + n):
            return False
        self._advance(view, hashed)
        return True

    def _check_next(self, at: int) -> None:
        if at != self._next:
            raise DataLoss(
                f"{self._file.label}: bytes for offset {at} arrived, expected offset {self._next}"
            )

    def _advance(self, view: memoryview, hashed: list[tuple[int, str]]) -> None:
        for index, digest in hashed:
            self._file.piece_hashed(index, digest)
        self._next += len(view)

    def _hash(self, at: int, view: memoryview) -> list[tuple[int, str]]:
        """Feeds ``view`` (at offset ``at``) to the part's piece hashes; returns the
        (index, sha256) of the pieces it completed, the file's short last one included.
        hashlib releases the GIL."""
        if self._pieces is None:
            return []
        digests = self._pieces.update(view)
        if at + len(view) == self._file.size:
            digests = list(self._pieces.finish()[self._reported :])
        indices = range(self._first + self._reported, self._first + self._reported + len(digests))
        self._reported += len(digests)
        return list(zip(indices, digests, strict=True))
