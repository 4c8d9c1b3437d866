"""Where packed adapters' host memory comes from: slabs taken once and recycled.

Every packed tensor used to be fresh memory, returned to the kernel when the host cache
evicted it, and that costs at both ends:

* on a CUDA executor it is page-locked, and torch's pinned allocator rounds every request up
  to a power of two (a 630 MB layer held 896 MiB) and keeps freed blocks per size class for
  good, so the host cache's budget understated its real footprint by up to half; fresh blocks
  map at about 5 GB/s (H100 host, 8 threads), beside the download of a cold load;
* on the CPU every page of a fresh tensor faults on first touch (three times the cost of the
  writing), and on a VM whose balloon reports free memory to its host the host faults too:
  fresh memory touched at 0.44–0.50 GB/s on the 2-core VM, against 6.6–8.7 GB/s for memory
  touched before (docs/decisions/0006-host-cache-memory-pool.md).

So the pool takes slabs of host memory up to a capacity (the host cache's budget plus room for
the packs in flight), page-locked on a CUDA executor, on transparent huge pages on the CPU;
it hands out each packed tensor as a range of a slab (first fit, page-aligned) and takes the
range back once the last tensor viewing it is freed: evicted from the host cache, and no slot
write holding it any more. On a CUDA executor a range freed is handed out again only after
the copies the slot writes had enqueued on their stream (``reader``) by then. What the slabs
cannot hold (a tensor larger than a slab, or the capacity taken) gets fresh memory, as before,
so the pool is never a reason for a load to fail. ``reserve`` takes every slab at start-up:
the first loads then find their memory ready too. Measured (docs/decisions/0006): on an H100
host, slabs reserved against taken as needed, cold loads 1.88–2.12 GB/s
against 1.74–1.91 and the pack alone 6.2–7.0 against 4.7–5.7; on the 2-core VM, disk-warm loads
3.0–3.3 GB/s against 0.6–0.8 before the pool, and cold 0.87–0.96 reserved against 0.26.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moelora.client.logs import log_event

log = logging.getLogger(__name__)

#: Bytes of one slab (a power of two: torch's pinned allocator would round it up to one).
SLAB_BYTES = 1 << 30

#: Ranges start at page boundaries.
ALIGN_BYTES = 4096

#: Below this a fresh CPU tensor is allocated as usual (a huge page is 2 MiB on x86-64).
_HUGE_PAGE_BYTES = 4 << 20


@dataclass
class _Slab:
    """A contiguous run of host memory and its free ranges, (offset, size) by offset."""

    address: int
    size: int
    #: What owns the memory (an anonymous mapping, or a page-locked torch tensor).
    owner: object
    free: list[tuple[int, int]] = field(default_factory=list)

    def take(self, size: int) -> int | None:
        """The offset of ``size`` bytes taken from the first free range that holds them."""
        for index, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[index]
                else:
                    self.free[index] = (offset + size, length - size)
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        """Returns a range, merged with its free neighbours."""
        index = next((i for i, (at, _) in enumerate(self.free) if at > offset), len(self.free))
        if index < len(self.free) and offset + size == self.free[index][0]:
            size += self.free.pop(index)[1]
        if index and self.free[index - 1][0] + self.free[index - 1][1] == offset:
            offset, size = self.free[index - 1][0], self.free[index - 1][1] + size
            index -= 1
            del self.free[index]
        self.free.insert(index, (offset, size))


@dataclass(frozen=True)
class _Freed:
    """A range whose tensors are gone, and the reader's work it must wait for (CUDA)."""

    slab: _Slab
    offset: int
    size: int
    fence: torch.cuda.Event | None


class HostPool:
    """Host memory for packed tensors: ranges of slabs, at most ``capacity`` bytes of them,
    page-locked for ``device`` when it is a CUDA device (see the module doc). ``reserve``:
    take (and touch) every slab now. ``reader``: the stream that copies from the tensors.
    ``on_fresh``: told the bytes of each tensor the slabs had no room for. A capacity of 0
    gives fresh memory every time."""

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        reserve: bool = False,
        reader: torch.cuda.Stream | None = None,
        on_fresh: Callable[[int], None] | None = None,
    ) -> None:
        self.pinned = device.type == "cuda"
        self._device = device
        self._reader = reader
        self._on_fresh = on_fresh
        #: A slab no larger than the capacity needs, so that a small pool takes little.
        self.slab_bytes = min(SLAB_BYTES, 1 << max(capacity - 1, ALIGN_BYTES).bit_length())
        self._max_slabs = -(-capacity // self.slab_bytes) if capacity > 0 else 0
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        #: Ranges freed by tensors' finalizers (any thread, any time): merged under the lock.
        self._freed: deque[_Freed] = deque()
        self._pending: list[_Freed] = []
        self._used = 0
        if reserve and self._max_slabs:
            start = time.perf_counter()
            with self._lock:
                while len(self._slabs) < self._max_slabs:
                    self._add_slab(touch=True)
            log_event(
                log,
                "host_memory_reserved",
                bytes=self.reserved_bytes,
                pinned=self.pinned,
                seconds=round(time.perf_counter() - start, 4),
            )

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slabs taken so far."""
        return len(self._slabs) * self.slab_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the slabs held by live tensors (or freed, waiting for their copies)."""
        with self._lock:
            self._merge(wait=False)
            return self._used

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor, in a slab where one has room, else fresh memory."""
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        placed = None
        if 0 < size <= self.slab_bytes and self._max_slabs:
            with self._lock:
                placed = self._place(size)
        if placed is None:
            if nbytes and self._on_fresh is not None:
                self._on_fresh(nbytes)
            return self._fresh(tuple(shape), dtype)
        slab, offset = placed
        memory = (ctypes.c_char * nbytes).from_address(slab.address + offset)
        memory._owner = slab.owner  # type: ignore[attr-defined]  # the slab outlives its views
        done = weakref.finalize(memory, self._free, slab, offset, size)
        done.atexit = False
        return torch.frombuffer(memory, dtype=dtype, count=count).reshape(tuple(shape))

    def _place(self, size: int) -> tuple[_Slab, int] | None:
        """A free range of ``size`` bytes: recycled, else in a new slab while the capacity
        allows (the lock held)."""
        self._merge(wait=False)
        found = self._first_fit(size)
        if found is None and self._pending:  # ranges whose copies are still running
            self._merge(wait=True)
            found = self._first_fit(size)
        if found is None and len(self._slabs) < self._max_slabs:
            self._add_slab(touch=False)
            found = self._first_fit(size)
        if found is not None:
            self._used += size
        return found

    def _first_fit(self, size: int) -> tuple[_Slab, int] | None:
        for slab in self._slabs:
            offset = slab.take(size)
            if offset is not None:
                return slab, offset
        return None

    def _free(self, slab: _Slab, offset: int, size: int) -> None:
        """A range's last tensor is gone (a finalizer: no lock may be taken here)."""
        fence = None
        if self._reader is not None:
            fence = torch.cuda.Event()  # type: ignore[no-untyped-call]
            fence.record(self._reader)
        self._freed.append(_Freed(slab, offset, size, fence))

    def _merge(self, wait: bool) -> None:
        """Gives back the freed ranges whose readers are done (all of them, after waiting
        for their copies, when ``wait``)."""
        while self._freed:
            self._pending.append(self._freed.popleft())
        still = []
        for freed in self._pending:
            if freed.fence is not None and not freed.fence.query():  # type: ignore[no-untyped-call]
                if not wait:
                    still.append(freed)
                    continue
                freed.fence.synchronize()
            freed.slab.give(freed.offset, freed.size)
            self._used -= freed.size
        self._pending = still

    def _add_slab(self, touch: bool) -> None:
        """Takes one more slab; ``touch``: fault its pages in now, not in the first loads
        (a page-locked one always is)."""
        size = self.slab_bytes
        if self.pinned:
            with torch.cuda.device(self._device):  # page-locked for this device's context
                owner: object = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            address = owner.data_ptr()  # type: ignore[attr-defined]
        else:
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            _advise_huge_pages(region)
            owner = region
            address = ctypes.addressof(ctypes.c_char.from_buffer(region))
            if touch:
                torch.frombuffer(region, dtype=torch.uint8).zero_()
        self._slabs.append(_Slab(address, size, owner, [(0, size)]))

    def _fresh(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pinned:
            with torch.cuda.device(self._device):
                return torch.empty(shape, dtype=dtype, pin_memory=True)
        return _huge_paged(shape, dtype)


def _huge_paged(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; a large one in an anonymous mapping of its own that asks
    for transparent huge pages (with 4 KiB pages the first-touch faults cost about three times
    the writing: on the 2-core VM, 630 MB written into fresh memory 287 ms, into memory touched
    before 74 ms, into fresh 2 MiB pages 109 ms). Unmapped when the tensor is freed."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < _HUGE_PAGE_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise_huge_pages(region)
    return torch.frombuffer(region, dtype=dtype, count=count).reshape(tuple(shape))


def _advise_huge_pages(region: mmap.mmap) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without them: ordinary pages
            region.madvise(advice)
