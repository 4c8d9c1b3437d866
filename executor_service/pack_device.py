"""Where an adapter's packing arithmetic runs: on the CPU, or on the executor's CUDA device.

``packer.py`` decides what is computed (reshape A, gather and scale B, check); a
``PackDevice`` supplies the stored tensors on the device that computes, buffers there, and the
packed tensors as the host cache keeps them:

* ``CpuPackDevice``: stored tensors are views of the weights buffer (a memory map, or a file
  still arriving: each tensor waits for its own bytes), and the packed buffers are the host
  tensors themselves (from the host pool, ``host_pool.py``), so every byte is written once.
* ``CudaPackDevice``: at the start of each layer its stored bytes go host→device. From a file
  whose pages the driver registers read-only (``page_cache_dma.py``), the copy engine reads
  the page cache directly, a registered window at a time; otherwise they go through two small
  reusable page-locked staging buffers, chunk by chunk (one filled while the other's copy runs:
  by pread from a file, in as many slices at once as the load has threads, so that the serving
  process maps none of the file's pages). Each window or chunk waits for its bytes when the
  file is still arriving. The packing runs on a side stream (one per device, so that the caching
  allocator reuses its blocks from one pack to the next); at the layer's end the packed
  tensors come back into page-locked host tensors and the stream is synchronised: device memory
  holds about one layer (its stored bytes, its packed tensors, the gather's scratch) at a
  time. Both copies are enqueued without pacing (``bulk_copy.py``): Forward's input and
  output do not use the copy engines. The page-locked host tensors (from the host pool) are
  allocated ahead, on a thread of their own, while the bytes still arrive (``expect``): where
  the pool has no room, fresh page-locked memory maps at a few GB/s.

Both run the same torch ops on the same values, each rounding once as IEEE says (casts round to
nearest even; a reduced float type is multiplied in float32), so a CUDA pack is bit-identical to
a CPU pack (tests/executor/test_packing.py). Only the band size of B's gather differs: the
CPU blocks it to stay in its cache, a GPU takes a tensor at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from executor_service.bulk_copy import copy_in_pieces
from executor_service.host_pool import HostPool
from executor_service.page_cache_dma import WINDOW_BYTES, MappedFile, RegisterError, Window
from moelora.client.logs import log_event
from moelora.client.safetensors_header import SafetensorsHeader

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}

#: Bytes of one page-locked staging buffer (two per CUDA pack).
STAGING_BYTES = 4 << 20

#: Source bytes of one band of B's gather on the CPU: a core's share of its L2 cache, where the
#: band's transposed scratch then stays for the scaling pass (measured on the 2-core VM: 1 MiB
#: bands 2.2 GB/s, 128 KiB 1.7, the whole tensor 1.8).
CPU_BAND_BYTES = 1 << 20


#: Waits for a byte range of the weights to have arrived.
Wait = Callable[[int, int], None]

#: Fills a buffer with the weights file's bytes from an offset (pread).
Read = Callable[[int, memoryview], None]


def _arrived(_begin: int, _end: int) -> None:
    pass


@dataclass(frozen=True)
class StoredTensors:
    """An adapter's weights file: its parsed header, its bytes (writable, as torch.frombuffer
    wants; never written), the wait for a byte range to have arrived and, for a file on disk,
    a read of its bytes that maps none of them into this process (``file_reader``) and its
    pages for a device to copy from (``page_cache_dma.open_for_dma``)."""

    header: SafetensorsHeader
    data: memoryview
    wait: Wait
    read: Read | None = None
    pages: MappedFile | None = None

    def span(self, key: str) -> tuple[int, int]:
        """The file offsets of a tensor's bytes."""
        info = self.header.tensors[key]
        start = self.header.data_start + info.begin
        return start, start + info.nbytes

    def host(self, key: str) -> torch.Tensor:
        """A stored tensor as a CPU view of the buffer, once its bytes have arrived."""
        info = self.header.tensors[key]
        dtype = TORCH_DTYPES[info.dtype]
        start, end = self.span(key)
        self.wait(start, end)
        if start == end:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(self.data, dtype=dtype, count=info.numel, offset=start).reshape(
            info.shape
        )


def open_weights(weights: bytes | memoryview | Path) -> tuple[memoryview, Wait]:
    """Weights in memory or on disk as a writable buffer (all arrived). A file is
    memory-mapped copy-on-write (writable as torch.frombuffer wants, never written, so nothing
    is copied); the map is unmapped when the last tensor viewing it is gone, not closed here,
    since a traceback may hold one. Read-only bytes are copied once."""
    if isinstance(weights, bytes | memoryview):
        view = memoryview(weights)
        return (memoryview(bytearray(view)) if view.readonly else view), _arrived
    with weights.open("rb") as handle:
        if handle.seek(0, 2) == 0:
            return memoryview(bytearray()), _arrived
        return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)), _arrived


@contextlib.contextmanager
def file_reader(path: Path | None) -> Iterator[Read | None]:
    """A pread of ``path`` (None: none), open while the context lasts. A CUDA pack stages the
    file through it: the kernel copies the page cache into the page-locked staging buffer, so
    the serving process maps none of the file's pages (through a memory map it took one page
    fault per 4 KiB, some 300 000 for a 1.26 GB adapter, beside Forward's threads)."""
    if path is None:
        yield None
        return
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(offset: int, into: memoryview) -> None:
            while into:
                count = os.preadv(fd, [into], offset)  # releases the GIL
                if not count:
                    raise EOFError(f"{path} ends at byte {offset}, before the tensors it lists")
                into, offset = into[count:], offset + count

        yield read
    finally:
        os.close(fd)


class PackDevice(Protocol):
    """Where the packing arithmetic runs (see the module doc)."""

    #: Source bytes of one band of B's transposing gather.
    band_bytes: int

    def running(self) -> contextlib.AbstractContextManager[object]:
        """The context the whole pack runs in (the device and its stream made current)."""
        ...

    def begin_layer(self, keys: Sequence[str]) -> None:
        """A layer that reads ``keys`` begins."""
        ...

    def tensor(self, key: str) -> torch.Tensor:
        """A stored tensor on the device, once its bytes have arrived (of the current layer)."""
        ...

    def empty(self, shape: Sequence[int]) -> torch.Tensor:
        """An uninitialised buffer on the device in the serving dtype."""
        ...

    def host(self, packed: torch.Tensor) -> torch.Tensor:
        """A packed tensor as the host cache keeps it (ready once ``end_layer`` returned)."""
        ...

    def expect(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """The shapes of the tensors the pack will hand to ``host``, in that order, told
        before the first layer: a device may allocate their host memory ahead."""
        ...

    def end_layer(self) -> None:
        """The layer's work is done and its host tensors are written."""
        ...


def pack_device(
    device: torch.device, stored: StoredTensors, dtype: torch.dtype, memory: HostPool
) -> PackDevice:
    """The pack device for ``device``, writing its host tensors into ``memory`` (a CUDA pack
    needs page-locked memory there)."""
    if device.type == "cuda":
        if not memory.pinned:
            raise ValueError("a CUDA pack writes into page-locked host memory")
        with torch.cuda.device(device):  # "cuda" alone: the current one
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaPackDevice(device, stored, dtype, memory)
    if device.type != "cpu":
        raise ValueError(f"cannot pack adapters on a {device.type} device")
    return CpuPackDevice(stored, dtype, memory)


class CpuPackDevice:
    """Packs on the CPU, straight into the host tensors."""

    band_bytes = CPU_BAND_BYTES

    def __init__(self, stored: StoredTensors, dtype: torch.dtype, memory: HostPool) -> None:
        self._stored = stored
        self._dtype = dtype
        self._memory = memory

    def running(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def begin_layer(self, keys: Sequence[str]) -> None:
        pass  # each tensor waits for its bytes when it is read: the pack trails a download

    def tensor(self, key: str) -> torch.Tensor:
        return self._stored.host(key)

    def empty(self, shape: Sequence[int]) -> torch.Tensor:
        return self._memory.empty(shape, self._dtype)

    def host(self, packed: torch.Tensor) -> torch.Tensor:
        return packed

    def expect(self, shapes: Sequence[tuple[int, ...]]) -> None:
        pass  # the packed buffers are the host tensors: allocated as they are filled

    def end_layer(self) -> None:
        pass


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's packing stream. One per device for the process: the caching allocator
    keeps freed blocks per stream, so a new stream per pack would strand a layer's worth of
    device memory each time."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


class CudaPackDevice:
    """Packs on a CUDA device: stored bytes staged in, packed tensors copied back."""

    band_bytes = sys.maxsize  # the GPU gathers a whole tensor at once

    def __init__(
        self,
        device: torch.device,
        stored: StoredTensors,
        dtype: torch.dtype,
        memory: HostPool,
    ) -> None:
        self._device = device
        self._stored = stored
        self._dtype = dtype
        self._memory = memory
        self._stream = _side_stream(device)
        self._source = (
            torch.frombuffer(stored.data, dtype=torch.uint8)
            if len(stored.data)
            else torch.empty(0, dtype=torch.uint8)
        )
        with torch.cuda.device(device):  # page-locked for this device's context
            self._staging = [
                torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        self._staging_bytes = [_writable_bytes(buffer) for buffer in self._staging]
        #: Reads fill a staging buffer in as many slices at once as the calling (loader) thread
        #: has torch threads (``--load-threads``), up to ``_MAX_FILL_SLICES``: more load faster
        #: and slow Forward more (see loader.CUDA_LOAD_THREADS). The threads share its nice.
        self._slices = max(1, min(_MAX_FILL_SLICES, torch.get_num_threads()))
        self._fillers = (
            ThreadPoolExecutor(self._slices - 1, thread_name_prefix="pack-fill")
            if self._slices > 1 and stored.read is not None
            else None
        )
        self._turn = 0
        #: Per staging buffer: recorded after the last copy out of it (it is refilled after).
        self._staged: list[torch.cuda.Event | None] = [None, None]
        #: The file's pages, registered a window at a time; on until a registration fails.
        self._pages = stored.pages
        self._dma = stored.pages is not None
        #: The registered window the last copy was made from, and recorded after that copy.
        self._held: Window | None = None
        self._held_copied: torch.cuda.Event | None = None
        #: The current layer's tensors: the device buffer holding each, and its offset there.
        self._placed: dict[str, tuple[torch.Tensor, int]] = {}
        #: The current layer's packed tensors and the host tensors they go to at its end.
        self._outgoing: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Host tensors being allocated ahead, in the order ``host`` will want them.
        self._ahead: deque[Future[torch.Tensor]] = deque()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        try:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                yield
        finally:
            if self._fillers is not None:
                self._fillers.shutdown()

    def begin_layer(self, keys: Sequence[str]) -> None:
        """Stages the layer's bytes, one device buffer per run of tensors lying together in
        the file (a layer's usually do: one buffer, filled by a few large copies)."""
        for run in coalesce([(*self._stored.span(key), key) for key in keys], _GAP_BYTES):
            begin = run[0][0]
            buffer = self._stage(begin, max(end for _, end, _ in run))
            for start, _, key in run:
                self._placed[key] = (buffer, start - begin)

    def _stage(self, begin: int, end: int) -> torch.Tensor:
        """Bytes [begin, end) of the file in a new device buffer, copied asynchronously from
        its registered pages, else through the staging buffers, a window at a time."""
        out = torch.empty(end - begin, dtype=torch.uint8, device=self._device)
        step = WINDOW_BYTES if self._dma else self._staging[0].numel()
        try:
            for start, stop in aligned_pieces(begin, end, step):
                self._stored.wait(start, stop)
                window = self._register(start, stop)
                if window is None:
                    self._copy_staged(out[start - begin : stop - begin], start)
                else:
                    self._copy_registered(out[start - begin : stop - begin], window, start)
        finally:
            self._release_held()  # its pages stay pinned until its copies are done
        return out

    def _register(self, begin: int, end: int) -> Window | None:
        """The file's pages holding [begin, end) registered, or None: stage them (for the rest
        of the pack once a registration failed)."""
        if self._pages is None or not self._dma:
            return None
        try:
            return self._pages.register(begin, end)
        except RegisterError as exc:
            log_event(
                log, "page_cache_dma_declined", logging.WARNING, error=str(exc),
                action="adapter bytes go through staging buffers from here on",
            )  # fmt: skip
            self._dma = False
            return None

    def _copy_registered(self, out: torch.Tensor, window: Window, start: int) -> None:
        """out ← the file's bytes from ``start`` (registered in ``window``), one copy. The
        window was registered while the copy from the one before ran."""
        self._release_held()
        self._held = window
        out.copy_(window.tensor(start, start + out.numel()), non_blocking=True)
        self._held_copied = _recorded(self._stream)

    def _copy_staged(self, out: torch.Tensor, start: int) -> None:
        """out ← the file's bytes from ``start`` through the two staging buffers: one is filled
        while the other's copy runs (its own last copy went before it)."""
        size = self._staging[0].numel()
        for at in range(0, out.numel(), size):
            count = min(size, out.numel() - at)
            turn, self._turn = self._turn, 1 - self._turn
            if (copied := self._staged[turn]) is not None:
                copied.synchronize()  # its last copy is done: it may be refilled
            if self._stored.read is not None:
                self._fill(self._stored.read, start + at, self._staging_bytes[turn][:count])
            else:
                self._staging[turn][:count].copy_(self._source[start + at : start + at + count])
            out[at : at + count].copy_(self._staging[turn][:count], non_blocking=True)
            self._staged[turn] = _recorded(self._stream)

    def _release_held(self) -> None:
        """Releases the registered window copies were last made from, once they are done."""
        if self._held is not None and self._pages is not None:
            if self._held_copied is not None:
                self._held_copied.synchronize()
            held, self._held = self._held, None
            self._pages.release(held)

    def _fill(self, read: Read, start: int, into: memoryview) -> None:
        """Reads the file's bytes from ``start`` into ``into``, slices in parallel."""
        if self._fillers is None:
            read(start, into)
            return
        step = -(-len(into) // self._slices)
        pending = [
            self._fillers.submit(read, start + at, into[at : at + step])
            for at in range(step, len(into), step)
        ]
        read(start, into[:step])
        for future in pending:
            future.result()

    def tensor(self, key: str) -> torch.Tensor:
        info = self._stored.header.tensors[key]
        dtype = TORCH_DTYPES[info.dtype]
        buffer, offset = self._placed[key]
        # offset is a multiple of the itemsize: a run starts at a tensor, and an adapter's
        # tensors share one dtype (inspect_adapter refuses others).
        return buffer[offset : offset + info.nbytes].view(dtype).reshape(info.shape)

    def empty(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=self._dtype, device=self._device)

    def host(self, packed: torch.Tensor) -> torch.Tensor:
        if not self._ahead:
            raise RuntimeError("a packed tensor the pack did not announce (expect)")
        out = self._ahead.popleft().result()
        if out.shape != packed.shape or out.dtype != packed.dtype:  # the packer's own bug
            raise RuntimeError(
                f"the pack announced a {tuple(out.shape)} {out.dtype} tensor, then packed a "
                f"{tuple(packed.shape)} {packed.dtype} one"
            )
        self._outgoing.append((out, packed))
        return out

    def expect(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Allocates the page-locked host tensors on a thread of their own while the layers'
        bytes arrive and pack: where the host pool has no room, fresh page-locked memory is
        slow to map (about 5 GB/s on an H100 host), and a cold load would otherwise wait for
        it after each layer."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="pin-ahead")
        for shape in shapes:
            self._ahead.append(pool.submit(self._memory.empty, shape, self._dtype))
        pool.shutdown(wait=False)  # the thread ends once the last one is allocated

    def end_layer(self) -> None:
        try:
            for out, packed in self._outgoing:
                copy_in_pieces(out, packed)
        finally:  # no copy may still write a host tensor the pool could hand out again
            self._stream.synchronize()
        self._outgoing.clear()
        self._placed.clear()  # the layer's device buffers go back to the allocator


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event after the work enqueued on ``stream`` so far; waiting on it sleeps."""
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as writable bytes (it must outlive the view)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


#: Most slices a staging buffer is read in at once (see CudaPackDevice).
_MAX_FILL_SLICES = 4

#: Tensors at most this far apart in the file are staged as one run (the bytes between them
#: are copied too).
_GAP_BYTES = 64 << 10


def aligned_pieces(begin: int, end: int, step: int) -> Iterator[tuple[int, int]]:
    """[begin, end) cut at the multiples of ``step``: a window of registered pages ends at
    one, so that the next shares no page with it."""
    start = begin
    while start < end:
        stop = min((start // step + 1) * step, end)
        yield start, stop
        start = stop


def coalesce(spans: Sequence[tuple[int, int, str]], gap: int) -> list[list[tuple[int, int, str]]]:
    """(begin, end, key) spans in file order, grouped into runs whose neighbours are at most
    ``gap`` bytes apart."""
    runs: list[list[tuple[int, int, str]]] = []
    for span in sorted(spans):
        if runs and span[0] <= max(end for _, end, _ in runs[-1]) + gap:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs
