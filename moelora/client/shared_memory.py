"""Same-host shared memory: POSIX shared-memory objects by name, mapped into this process, and
the ring of Forward slots a client registers with an executor on its host once.

With a ring, ``ExecutorClient.forward(..., ring=ring)`` writes the input into a free slot of the
client's shared memory, sends only descriptors (region, offset, dtype, shape), and reads the
output that the executor wrote into the same slot: the tensors never cross the RPC. A call that
finds every slot busy, more tokens than a slot holds or another dtype than the ring's sends its
bytes in the message instead, so a ring never fails a call that would work without it.

``SharedMemory`` of Python 3.11's standard library registers every segment it attaches to with
a resource tracker that unlinks it when the attaching process exits, which would destroy a
front end's arena or a client's region under its owner. So segments are opened here directly
as the files POSIX ``shm_open`` makes on Linux (``/dev/shm/NAME``), and only their creator
unlinks them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np

from moelora.client.errors import DeadlineExceeded, MoeLoraError, Unavailable
from moelora.client.logs import log_event
from moelora.client.tensors import WIRE_TYPES, dtype_from_name
from moelora.v1 import executor_pb2

if TYPE_CHECKING:
    import torch

    from moelora.client.tensors import DataTypeCode

#: What a ring takes and gives back: numpy arrays, or torch tensors (bfloat16 too).
Array = TypeVar("Array", bound="np.ndarray[Any, Any] | torch.Tensor")

log = logging.getLogger(__name__)

#: Where POSIX shared-memory objects live on Linux.
SHM_ROOT = Path("/dev/shm")
#: madvise(2) advice that faults pages in for writing (Linux 5.14; not in Python's mmap yet).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: What a segment name may be: one path component, as ``shm_open`` takes it (without "/").
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


class Segment:
    """One mapped shared-memory segment. ``create`` makes a new one of ``size`` bytes (and
    unlinks it on ``close``); otherwise an existing one is mapped whole."""

    def __init__(self, name: str, size: int = 0, *, create: bool = False) -> None:
        if not valid_name(name):
            raise ValueError(f"not a shared-memory name: {name!r}")
        self.name = name
        self._owner = create
        path = SHM_ROOT / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise ValueError(f"shared-memory segment {name!r} is empty")
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.buffer = memoryview(self._map)

    @classmethod
    def create_unique(cls, prefix: str, size: int) -> Segment:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}", size, create=True)

    def populate(self, offset: int, length: int) -> None:
        """Takes the pages of ``length`` bytes at ``offset`` (page-aligned) now: OSError if
        they cannot be had (a full /dev/shm) where a first write would raise SIGBUS. Linux
        5.14's MADV_POPULATE_WRITE; EINVAL on older kernels."""
        self._map.madvise(_MADV_POPULATE_WRITE, offset, length)

    def unlink(self) -> None:
        """Removes the name (the mappings stay until closed)."""
        (SHM_ROOT / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Unmaps it (views of ``buffer`` must be gone) and, if this process made it, unlinks
        it. Idempotent."""
        if self._map.closed:
            return
        self.buffer.release()
        # A view may still point into the map (a tensor in flight): then the mapping lives
        # until that view goes, and only the name goes now.
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._owner:
            self.unlink()


@dataclass(frozen=True)
class Slot:
    """One slot of a ring: ``tokens`` rows of input at ``input_offset``, the output right after."""

    index: int
    tokens: int
    input_offset: int
    output_offset: int


class SlotPool:
    """``slots`` Forward slots, each ``area`` bytes of input followed by as many of output,
    for up to ``max_tokens`` rows of ``hidden_size``: the bookkeeping of every ring.
    Thread-safe."""

    def __init__(self, slots: int, max_tokens: int, hidden_size: int, area: int) -> None:
        if hidden_size < 1 or max_tokens < 1 or slots < 1:
            raise ValueError("hidden_size, max_tokens and slots must be at least 1")
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.area = area
        self._lock = threading.Lock()
        self._free = list(range(slots))
        #: Slots taken out of use (``retire``).
        self.retired = 0

    def take(self, shape: tuple[int, ...]) -> Slot | None:
        """A free slot for a (T, H) tensor of ``shape``; None if it does not fit one or every
        slot is busy."""
        if len(shape) != 2 or not 1 <= shape[0] <= self.max_tokens or shape[1] != self.hidden_size:
            return None
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
        start = 2 * index * self.area
        return Slot(index, int(shape[0]), start, start + self.area)

    def give_back(self, slot: Slot) -> None:
        with self._lock:
            self._free.append(slot.index)

    def retire(self, slot: Slot) -> None:
        """Never hands ``slot`` out again (``settle``)."""
        with self._lock:
            self.retired += 1


def slot_request(
    region: str,
    dtype_code: DataTypeCode,
    hidden_size: int,
    slot: Slot,
    layer: int,
    segments: list[executor_pb2.Segment],
) -> executor_pb2.ForwardRequest:
    """The Forward request naming ``slot`` of ``region`` for its input and its output."""
    shape = [slot.tokens, hidden_size]
    return executor_pb2.ForwardRequest(
        layer=layer,
        segments=segments,
        shared_hidden_states=executor_pb2.SharedTensor(
            region=region, offset=slot.input_offset, dtype=dtype_code, shape=shape
        ),
        shared_output=executor_pb2.SharedTensor(
            region=region, offset=slot.output_offset, dtype=dtype_code, shape=shape
        ),
    )


class ForwardRing(Protocol):
    """Slots for Forward's tensors that a client registered with an executor: a
    ``SharedMemoryRing``, or a ``moelora.client.cuda_ring.CudaMemoryRing``."""

    region: str

    def take(self, hidden: Any) -> Slot | None: ...

    def give_back(self, slot: Slot) -> None: ...

    def retire(self, slot: Slot) -> None: ...

    def request(
        self, slot: Slot, hidden: Any, layer: int, segments: list[executor_pb2.Segment]
    ) -> executor_pb2.ForwardRequest: ...

    def output(self, slot: Slot, like: Array) -> Array: ...


def settle(ring: ForwardRing, slot: Slot, failure: BaseException | None) -> None:
    """Ends a call's use of ``slot``: given back once the executor answered (``failure`` is
    None or the executor's own error), retired when the call ended without its answer (a
    deadline, a lost connection, a cancelled caller): the executor may still read the input
    there and write the output later, over a later call's."""
    if failure is None or (
        isinstance(failure, MoeLoraError)
        and not isinstance(failure, DeadlineExceeded | Unavailable)
    ):
        ring.give_back(slot)
        return
    ring.retire(slot)
    log_event(
        log,
        "ring_slot_retired",
        logging.WARNING,
        region=ring.region,
        slot=slot.index,
        reason=type(failure).__name__,
    )


class SharedMemoryRing:
    """``slots`` Forward slots of up to ``max_tokens`` × ``hidden_size`` values of ``dtype``
    (input and output each) in one shared-memory object of this process, registered with an
    executor as ``region`` (``ExecutorClient.shared_memory`` makes and registers one).
    Thread-safe: each call takes a free slot and gives it back."""

    def __init__(
        self,
        region: str,
        hidden_size: int,
        max_tokens: int,
        slots: int = 4,
        dtype: str = "bfloat16",
    ) -> None:
        self.region = region
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.dtype_code = dtype_from_name(dtype)
        self.wire = WIRE_TYPES[self.dtype_code]
        area = max_tokens * hidden_size * self.wire.itemsize
        self._slots = SlotPool(slots, max_tokens, hidden_size, area)
        self.segment = Segment.create_unique("moelora-client", 2 * slots * area)

    @property
    def shm_name(self) -> str:
        return self.segment.name

    def register_request(self) -> executor_pb2.RegisterSharedMemoryRequest:
        return executor_pb2.RegisterSharedMemoryRequest(
            region=self.region, shm_name=self.segment.name, size=self.segment.size
        )

    def take(self, hidden: np.ndarray[Any, Any] | torch.Tensor) -> Slot | None:
        """A free slot that holds ``hidden`` (T, H) of the ring's dtype, or None (the call then
        sends its bytes in the message)."""
        if _dtype_name(hidden) != self.wire.name:
            return None
        return self._slots.take(tuple(int(d) for d in hidden.shape))

    def give_back(self, slot: Slot) -> None:
        self._slots.give_back(slot)

    def retire(self, slot: Slot) -> None:
        self._slots.retire(slot)

    def request(
        self, slot: Slot, hidden: Array, layer: int, segments: list[executor_pb2.Segment]
    ) -> executor_pb2.ForwardRequest:
        """Writes ``hidden`` into ``slot`` and returns the Forward request naming it."""
        self._view(slot.input_offset, slot.tokens, like=hidden)[...] = (
            hidden if isinstance(hidden, np.ndarray) else hidden.detach()
        )
        return slot_request(self.region, self.dtype_code, self.hidden_size, slot, layer, segments)

    def output(self, slot: Slot, like: Array) -> Array:
        """A copy of the output the executor wrote into ``slot``, of ``like``'s kind."""
        view = self._view(slot.output_offset, slot.tokens, like=like)
        return cast(Array, view.copy() if isinstance(view, np.ndarray) else view.clone())

    def _view(self, offset: int, tokens: int, like: object) -> Any:
        count = tokens * self.hidden_size
        if isinstance(like, np.ndarray):
            assert self.wire.numpy is not None
            flat = np.frombuffer(self.segment.buffer, self.wire.numpy, count, offset)
            return flat.reshape(tokens, self.hidden_size)
        import torch

        dtype = getattr(torch, self.wire.torch)
        tensor = torch.frombuffer(self.segment.buffer, dtype=dtype, count=count, offset=offset)
        return tensor.view(tokens, self.hidden_size)

    def close(self) -> None:
        """Unmaps and unlinks the shared memory (unregister it with the executor first)."""
        self.segment.close()


def _dtype_name(array: object) -> str:
    if isinstance(array, np.ndarray):
        return str(array.dtype.name)
    return str(getattr(array, "dtype", "")).removeprefix("torch.")  # a torch tensor
