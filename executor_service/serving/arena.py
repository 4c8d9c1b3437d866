"""Where a front end puts requests' tensors for the engine: one shared-memory segment and a
first-fit allocator over it.

A front end owns its arena: its handler threads take a region for a request's input and one
for its output, write the input there straight from the message's bytes, and hand the engine
only (offset, size) pairs; the engine maps the same segment and reads and writes in place. The
engine never allocates in it, so the lock is the front end's alone.

The segment's pages are taken as the arena grows, ``RESERVE_STEP`` at a time, populated before
the first region there is handed out: a /dev/shm that filled up meanwhile (other processes
share it) is then an error for the request that grows the arena, not a SIGBUS when the front
end or the engine first touches a page that cannot be had.
"""

from __future__ import annotations

import bisect
import errno
import threading
import time
from dataclasses import dataclass

from moelora.client.shared_memory import Segment

#: Regions start on this boundary (a cache line is 64 bytes; 256 suits vector copies too).
ALIGN = 256
#: The arena's pages are populated this many bytes at a time as it grows (a huge page's
#: worth: a few each for the largest requests, and resident memory that follows use).
RESERVE_STEP = 2 * 1024 * 1024


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes at ``offset`` of an arena."""

    offset: int
    nbytes: int


class ArenaFull(Exception):
    """No free range of the asked size right now."""


class Arena:
    """A shared-memory segment of ``size`` bytes with an allocator (see the module doc)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.size = segment.size
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        # Free ranges as sorted starts and their ends (coalesced on free).
        self._starts: list[int] = [0]
        self._ends: dict[int, int] = {0: self.size}
        self.used = 0
        #: Bytes from the start whose pages are populated (see the module doc).
        self.reserved = 0
        self._populate = True

    @classmethod
    def create(cls, prefix: str, size: int) -> Arena:
        return cls(Segment.create_unique(prefix, size))

    @property
    def name(self) -> str:
        return self.segment.name

    def allocate(self, nbytes: int, wait: float = 0.0) -> Region:
        """A region of at least ``nbytes``, waiting up to ``wait`` seconds for others to be
        freed; ArenaFull if none came (at once if the arena could never hold it)."""
        want = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                for start in self._starts:
                    end = self._ends[start]
                    if end - start >= want:
                        self._reserve(start + want)
                        self._take(start, end, want)
                        self.used += want
                        return Region(start, want)
                remaining = deadline - time.monotonic()
                if want > self.size or remaining <= 0:
                    raise ArenaFull(
                        f"{want} bytes do not fit the {self.size}-byte arena ({self.used} used)"
                    )
                self._freed.wait(remaining)

    def _reserve(self, end: int) -> None:
        """Populates the pages up to ``end`` (in ``RESERVE_STEP``s); ArenaFull if they cannot
        be had."""
        if end <= self.reserved or not self._populate:
            return
        grown = min(self.size, -(-end // RESERVE_STEP) * RESERVE_STEP)
        try:
            self.segment.populate(self.reserved, grown - self.reserved)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOSYS):  # a kernel before 5.14: as before
                self._populate = False
                return
            raise ArenaFull(
                f"shared memory (/dev/shm) has no room for the arena's next "
                f"{grown - self.reserved} bytes ({exc.strerror})"
            ) from None
        self.reserved = grown

    def _take(self, start: int, end: int, want: int) -> None:
        index = bisect.bisect_left(self._starts, start)
        del self._starts[index]
        del self._ends[start]
        if end - start > want:
            rest = start + want
            self._starts.insert(index, rest)
            self._ends[rest] = end

    def free(self, region: Region) -> None:
        start, end = region.offset, region.offset + region.nbytes
        with self._lock:
            self.used -= region.nbytes
            index = bisect.bisect_left(self._starts, start)
            if index < len(self._starts) and self._starts[index] == end:  # join the next
                end = self._ends.pop(end)
                del self._starts[index]
            if index > 0 and self._ends[self._starts[index - 1]] == start:  # join the previous
                self._ends[self._starts[index - 1]] = end
            else:
                self._starts.insert(index, start)
                self._ends[start] = end
            self._freed.notify_all()

    def view(self, region: Region) -> memoryview:
        return self.segment.buffer[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        self.segment.close()
