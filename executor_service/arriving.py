"""Where a file downloaded in parallel parts is assembled, checked and read while it arrives.

``ArrivingFile`` is a file of known size and sha256, allocated up front (so a full disk fails
before any byte is fetched) and filled by part workers in any order. It records which byte
ranges have arrived, so that a reader (the packer) can wait for the ranges it needs and use
them while the rest is still on its way, and it hashes the file in order by a thread of its
own as its contiguous prefix grows (the bytes are read back from the page cache through the
memory map: no copy). When the registry recorded the sha256 of the file's fixed-size pieces
(``Pieces``), there is no such thread: the worker that completes a piece hashes it, so the
check runs on as many cores as there are workers instead of one, in any order, and a bad piece
is named as it fails. ``wait_verified`` says whether the whole file matched: a reader may look
at bytes early, but nothing built from them may be published before that.

Parts arrive two ways: ``write`` stores bytes that came as objects (the registry's gRPC
stream) with ``pwrite``; ``receive_view`` hands out the file's own memory for a socket to
receive into (HTTP range reads: the one copy is the kernel's) and ``arrived`` records what
landed there. The memory map is shared (MAP_SHARED), so it sees the ``pwrite``s, and what is
written through it is the file's page cache itself.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from pathlib import Path

from executor_service.loader import lower_priority
from shared.errors import DataLoss
from shared.part_digests import Pieces

#: Bytes hashed per step, so that the hasher notices a cancel within milliseconds.
_HASH_STEP = 8 << 20


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
        """``pieces``: the file's piece digests, checked as each piece completes (by the
        thread that completed it); without them the whole file is hashed in order."""
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
        self._changed = threading.Condition()
        #: Disjoint arrived ranges [begin, end), sorted; few: each worker fills its part in order.
        self._arrived: list[tuple[int, int]] = []
        self._error: BaseException | None = None
        self._verified = False
        self._closed = False
        self._writing = 0
        #: Checked by pieces (when there are any: an empty file has none) or by one hasher.
        self._pieces = pieces if pieces is not None and size else None
        #: Per piece: whether a thread took it to hash; and how many are not yet verified.
        self._taken = bytearray(len(self._pieces.sha256) if self._pieces else 0)
        self._unverified = len(self._taken)
        self._hasher: threading.Thread | None = None
        if self._pieces is None:
            self._hasher = threading.Thread(target=self._hash, name="arriving-hash", daemon=True)
            self._hasher.start()

    # -- the workers' side -----------------------------------------------------------------

    def write(self, offset: int, data: bytes) -> None:
        """Stores bytes that arrived for ``offset``; dropped once the file is closed (a worker
        that was still receiving when the load was abandoned)."""
        with self._changed:
            if self._closed:
                return
            self._writing += 1  # close() waits for writes in progress: the fd stays theirs
        written_all = False
        try:
            view = memoryview(data)
            at = offset
            while view:  # pwrite may write less than asked
                written = os.pwrite(self._fd, view, at)
                view, at = view[written:], at + written
            written_all = True
        finally:
            with self._changed:
                self._writing -= 1
                complete = []
                if written_all and not self._closed:
                    complete = self._add(offset, offset + len(data))
                self._changed.notify_all()
        self._check_pieces(complete)

    def receive_view(self, begin: int, end: int) -> memoryview:
        """The file's bytes ``begin`` to ``end`` as writable memory, to receive a part into;
        tell ``arrived`` what landed. Writing after ``close`` is harmless (the map outlives
        the file) and recorded nowhere."""
        # (Mapping the pages ahead with madvise(MADV_POPULATE_WRITE) instead of letting them
        # fault in as the bytes land measured no faster on a 2-core VM: not done.)
        return self.view()[begin:end]

    def arrived(self, begin: int, end: int) -> bool:
        """Bytes ``begin`` to ``end`` landed in ``receive_view``'s memory; False once the file
        is closed (the receiver should stop). Hashes the pieces this completed, if any."""
        with self._changed:
            if self._closed:
                return False
            complete = self._add(begin, end)
            self._changed.notify_all()
        self._check_pieces(complete)
        return True

    def fail(self, error: BaseException) -> None:
        """The download failed: every waiter gets ``error`` (the first one reported)."""
        with self._changed:
            if self._error is None:
                self._error = error
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

    def _check_pieces(self, indices: list[int]) -> None:
        """Hashes pieces this thread completed (outside the lock: hashlib releases the GIL,
        so the workers hash in parallel) and records the outcome."""
        if not indices:
            return
        assert self._pieces is not None
        view = self.view()
        for index in indices:
            actual = self._pieces.digest(view, index)
            expected = self._pieces.sha256[index]
            with self._changed:
                if actual != expected:
                    if self._error is None:
                        begin, end = self._pieces.span(index, self.size)
                        self._error = DataLoss(
                            f"{self.label}: downloaded bytes {begin}-{end} (piece {index + 1} "
                            f"of {len(self._taken)}) have sha256 {actual}, expected {expected}"
                        )
                else:
                    self._unverified -= 1
                    self._verified = self._unverified == 0
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

    def _add(self, begin: int, end: int) -> list[int]:
        """Records an arrival; returns the pieces it completed, taken for the caller to hash
        (lock held)."""
        merged: list[tuple[int, int]] = []
        for b, e in sorted([*self._arrived, (begin, end)]):
            if merged and b <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((b, e))
        self._arrived = merged
        if self._pieces is None or begin >= end:
            return []
        complete = []
        for index in range(begin // self._pieces.size, (end - 1) // self._pieces.size + 1):
            if not self._taken[index] and self._has(*self._pieces.span(index, self.size)):
                self._taken[index] = 1
                complete.append(index)
        return complete
