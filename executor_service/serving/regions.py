"""Clients' memory, registered with the engine: same-host requests without their bytes.

A client on the executor's host registers a region once — a POSIX shared-memory object
(``RegisterSharedMemory``) or device memory exported by CUDA IPC (``RegisterCudaMemory``) —
under a name of its choosing, and then names a Forward's input and output as (region, offset)
in it; the engine reads the input and writes the output there in place, and the RPC carries
only the descriptor. Both kinds share one namespace per caller. Regions belong to the caller
that registered them (its token's scope): another caller cannot name them, list them or
unregister them. Every tensor's bounds are checked against the registered size. A region
unregistered while a request uses it stays mapped until that request is done.

A client owns its shared-memory object and may shrink it at any time. A read through a mapping
past the object's new end kills the reading process with SIGBUS — the whole engine, for every
client. So the engine reads and writes shared memory through the object's file descriptor
(``SharedRegions.read`` and ``write``: a shrunk object makes a read come up short, an error
for that request alone) and maps only the bytes it page-locks, which no CPU code touches.

On a GPU the engine may page-lock the start of each shared-memory region as it is registered
(``HostPinning``, within ``--shared-memory-pinned-bytes`` for all regions together, first
registered first served): requests whose tensors lie there are read and written by the GPU in
place, as those in a front end's arena are, instead of being copied through staging.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from stat import S_ISREG
from typing import Literal, Protocol

import torch

from moelora.client import cuda_ipc
from moelora.client.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from moelora.client.logs import log_event
from moelora.client.shared_memory import SHM_ROOT, valid_name

log = logging.getLogger(__name__)

#: Regions one caller may hold at once (of both kinds).
MAX_REGIONS_PER_SCOPE = 64


@dataclass(frozen=True)
class RegionInfo:
    """A registered region: ``shm_name`` for shared memory, ``device_uuid`` for CUDA memory;
    ``network``: a network channel's buffer, the engine's own memory (never registered)."""

    region: str
    kind: Literal["shm", "cuda", "network"]
    size: int
    shm_name: str = ""
    device_uuid: str = ""
    #: The CUDA IPC handle (what makes a CUDA region the same one when registered again).
    ipc_handle: bytes = field(default=b"", repr=False)

    @property
    def transport(self) -> str:
        """The label of ``moelora_executor_forward_requests_by_transport_total``."""
        return {"cuda": "cuda_memory", "shm": "shared_memory"}.get(self.kind, "network_channel")


class HostPinning:
    """Page-locks the start of shared-memory regions for a GPU (``cuda_ipc.register_host``)
    within a budget of bytes for all of them together. A failure costs only speed: that
    region's requests are then copied through staging."""

    def __init__(self, device: torch.device, budget: int) -> None:
        self._device = device
        self._budget = budget
        self._used = 0
        self._lock = threading.Lock()

    def take(self, pointer: int, size: int) -> int:
        """Page-locks up to ``size`` bytes from ``pointer`` (whole pages, what the budget has
        left); returns how many (0: none)."""
        with self._lock:
            nbytes = min(size, self._budget - self._used) // _PAGE * _PAGE
            if nbytes <= 0:
                return 0
            self._used += nbytes
        try:
            cuda_ipc.register_host(pointer, nbytes, self._device)
        except cuda_ipc.CudaError as exc:
            log_event(log, "region_pin_failed", logging.WARNING, error=str(exc))
            with self._lock:
                self._used -= nbytes
            return 0
        return nbytes

    def give(self, pointer: int, nbytes: int) -> None:
        """Ends a ``take`` (no launch may still read or write those bytes)."""
        try:
            cuda_ipc.unregister_host(pointer, self._device)
        except cuda_ipc.CudaError:  # a lost device: the pages go with the process
            log_event(log, "region_unpin_failed", logging.WARNING, exc_info=True)
        with self._lock:
            self._used -= nbytes


#: The page size ``HostPinning`` rounds to.
_PAGE = 4096


class _Memory(Protocol):
    #: The region's bytes (uint8, on the CPU or on a GPU).
    bytes: torch.Tensor
    #: Its first bytes that the GPU reads and writes in place (page-locked host memory).
    pinned: int

    def close(self) -> None: ...


class _SharedMemory:
    """A client's shared-memory object, read and written through ``fd`` (see the module
    doc); with ``pinning``, its page-locked start mapped as ``bytes`` for the GPU alone."""

    def __init__(self, fd: int, size: int, pinning: HostPinning | None) -> None:
        self.fd = fd
        self._pinning = pinning
        self._map: mmap.mmap | None = None
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self.pinned = 0
        if pinning is not None:
            self._map = mmap.mmap(fd, size)
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=size)
            self.pinned = pinning.take(self.bytes.data_ptr(), size)
            if not self.pinned:  # no budget left: read and written through fd alone
                self.bytes = torch.empty(0, dtype=torch.uint8)
                with contextlib.suppress(BufferError):
                    self._map.close()
                self._map = None

    def close(self) -> None:
        if self._pinning is not None and self.pinned:
            self._pinning.give(self.bytes.data_ptr(), self.pinned)
            self.pinned = 0
        self.bytes = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view in flight keeps it until it goes
                self._map.close()
        os.close(self.fd)


class _CudaMemory:
    pinned = 0  # device memory: read in place by its own kind of launch

    def __init__(self, pointer: int, size: int, device: torch.device) -> None:
        self._pointer = pointer
        self._device = device
        self.bytes = cuda_ipc.device_tensor(pointer, size)

    def close(self) -> None:
        del self.bytes
        try:
            cuda_ipc.close_ipc_handle(self._pointer, self._device)
        except cuda_ipc.CudaError as exc:  # the exporting process is gone: nothing to keep
            log_event(log, "cuda_region_close_failed", logging.WARNING, error=str(exc))


class HeldRegion:
    def __init__(self, info: RegionInfo, memory: _Memory) -> None:
        self.info = info
        self.memory = memory
        self.users = 0
        self.registered = True

    @property
    def on_device(self) -> bool:
        """Viewed in place by the engine (CUDA memory, or a network channel's buffer)."""
        return self.info.kind != "shm"

    def maps(self, offset: int, nbytes: int) -> bool:
        """Whether those bytes lie in the region's page-locked start."""
        return offset >= 0 and offset + nbytes <= self.memory.pinned


class SharedRegions:
    """The engine's registered client regions, per scope (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scopes: dict[str, dict[str, HeldRegion]] = {}

    def register(
        self,
        scope: str,
        region: str,
        shm_name: str,
        size: int,
        pinning: HostPinning | None = None,
    ) -> RegionInfo:
        """A POSIX shared-memory object on this host; ``pinning`` page-locks its start."""
        if not valid_name(shm_name):
            raise InvalidArgument(
                f"shm_name: {shm_name!r} is not a POSIX shared-memory name (letters, digits, "
                "'.', '_' and '-', without '/')",
                "shm_name",
            )
        info = RegionInfo(_checked_name(region), "shm", size, shm_name=shm_name)
        return self._add(
            scope, info, lambda: _SharedMemory(_open_shm(shm_name, size), size, pinning)
        )

    def register_cuda(
        self,
        scope: str,
        region: str,
        handle: bytes,
        size: int,
        device_uuid: str,
        device: torch.device,
    ) -> RegionInfo:
        """Device memory another process on this host exported (``cudaIpcGetMemHandle``),
        mapped for the engine's ``device``."""
        if len(handle) != cuda_ipc.HANDLE_BYTES:
            raise InvalidArgument(
                f"ipc_handle: {len(handle)} bytes; a cudaIpcMemHandle_t has "
                f"{cuda_ipc.HANDLE_BYTES}",
                "ipc_handle",
            )
        if size <= 0:
            raise InvalidArgument("size: must be at least 1 byte", "size")
        if device.type != "cuda":
            raise FailedPrecondition(
                "ipc_handle: this executor computes on the CPU and cannot map CUDA memory; "
                "send the tensors' bytes or use shared memory",
                "ipc_handle",
            )
        info = RegionInfo(
            _checked_name(region), "cuda", size, device_uuid=device_uuid, ipc_handle=handle
        )
        return self._add(scope, info, lambda: _open_cuda(handle, size, device_uuid, device))

    def _add(self, scope: str, info: RegionInfo, open_memory: Callable[[], _Memory]) -> RegionInfo:
        with self._lock:
            if self._admit(scope, info):
                return info
        # Opened (and page-locked) without the lock: the launch loop takes it per request.
        memory = open_memory()
        with self._lock:
            try:
                if self._admit(scope, info):  # the same registration, raced
                    memory.close()
                    return info
            except BaseException:
                memory.close()
                raise
            self._scopes.setdefault(scope, {})[info.region] = HeldRegion(info, memory)
        return info

    def _admit(self, scope: str, info: RegionInfo) -> bool:
        """True if ``info`` is registered already; raises if the name is taken otherwise or
        the caller holds the most regions it may (called with the lock held)."""
        held = self._scopes.get(scope, {})
        known = held.get(info.region)
        if known is not None:
            if known.info == info:
                return True
            raise AlreadyExists(
                f"region: {info.region!r} is registered already ({_describe(known.info)}); "
                "unregister it first",
                "region",
            )
        if len(held) >= MAX_REGIONS_PER_SCOPE:
            raise ResourceExhausted(
                f"{MAX_REGIONS_PER_SCOPE} regions are registered by this caller, the most "
                "one may hold; unregister one first",
                "region",
            )
        return False

    def unregister(self, scope: str, region: str, kind: str) -> None:
        with self._lock:
            regions = self._scopes.get(scope, {})
            found = regions.get(region)
            if found is None or found.info.kind != kind:
                raise NotFound(f"region: {region!r} is not registered by this caller", "region")
            del regions[region]
            found.registered = False
            unused = found.users == 0
        if unused:  # unmapped (and unpinned) without the lock, which each request takes
            found.memory.close()

    def list(self, scope: str, kind: str) -> list[RegionInfo]:
        with self._lock:
            return [r.info for r in self._scopes.get(scope, {}).values() if r.info.kind == kind]

    def acquire(self, scope: str, region: str) -> HeldRegion:
        """Holds a region for one request (``release`` it after)."""
        with self._lock:
            found = self._scopes.get(scope, {}).get(region)
            if found is None:
                raise NotFound(
                    f"region: {region!r} is not registered by this caller "
                    "(RegisterSharedMemory, RegisterCudaMemory)",
                    "region",
                )
            found.users += 1
            return found

    def release(self, held: HeldRegion) -> None:
        with self._lock:
            held.users -= 1
            unused = held.users == 0 and not held.registered
        if unused:
            held.memory.close()

    @staticmethod
    def view(
        held: HeldRegion, offset: int, count: int, dtype: torch.dtype, field: str
    ) -> torch.Tensor:
        """``count`` elements of ``dtype`` at ``offset`` of ``held``, bounds checked: CUDA
        memory, or the page-locked start of shared memory (for the GPU alone to touch)."""
        nbytes = _checked_bytes(held, offset, count, dtype, field)
        if not held.on_device and not held.maps(offset, nbytes):
            raise ValueError("only CUDA memory and page-locked bytes are viewed")
        return held.memory.bytes[offset : offset + nbytes].view(dtype)

    @staticmethod
    def check(held: HeldRegion, offset: int, count: int, dtype: torch.dtype, field: str) -> None:
        """Raises InvalidArgument unless ``count`` elements of ``dtype`` at ``offset`` lie in
        ``held``, aligned."""
        _checked_bytes(held, offset, count, dtype, field)

    @staticmethod
    def read(
        held: HeldRegion, offset: int, shape: tuple[int, ...], dtype: torch.dtype, field: str
    ) -> torch.Tensor:
        """A copy of the tensor at ``offset`` of shared memory ``held``, bounds checked;
        FailedPrecondition if its owner shrank the object under it."""
        count = math.prod(shape)
        nbytes = _checked_bytes(held, offset, count, dtype, field)
        out = torch.empty(count, dtype=dtype)
        if nbytes:
            got = os.preadv(_shm(held).fd, [out.view(torch.uint8).numpy().data], offset)
            if got != nbytes:
                raise FailedPrecondition(
                    f"{field}: region {held.info.region!r} ends before byte "
                    f"{offset + nbytes}: its owner shrank the shared-memory object after "
                    "registering it",
                    field,
                )
        return out.view(shape)

    @staticmethod
    def write(held: HeldRegion, offset: int, tensor: torch.Tensor, field: str) -> None:
        """Writes ``tensor`` (on the CPU, checked against the region before) at ``offset`` of
        shared memory ``held``."""
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().data
        if data.nbytes and os.pwritev(_shm(held).fd, [data], offset) != data.nbytes:
            raise FailedPrecondition(
                f"{field}: the answer could not be written whole into region {held.info.region!r}",
                field,
            )


def _shm(held: HeldRegion) -> _SharedMemory:
    memory = held.memory
    if not isinstance(memory, _SharedMemory):
        raise ValueError("CUDA memory is viewed, not read")
    return memory


def _checked_bytes(
    held: HeldRegion, offset: int, count: int, dtype: torch.dtype, field: str
) -> int:
    nbytes = count * dtype.itemsize
    if offset < 0 or offset + nbytes > held.info.size:
        raise InvalidArgument(
            f"{field}: bytes [{offset}, {offset + nbytes}) lie outside region "
            f"{held.info.region!r} of {held.info.size} bytes",
            field,
        )
    if offset % dtype.itemsize:
        raise InvalidArgument(
            f"{field}: offset {offset} is not a multiple of the element size", field
        )
    return nbytes


def _checked_name(region: str) -> str:
    if not region or len(region) > 128:
        raise InvalidArgument("region: must be 1 to 128 characters", "region")
    return region


def _describe(info: RegionInfo) -> str:
    if info.kind == "shm":
        return f"to {info.shm_name}, {info.size} bytes"
    return f"to CUDA memory of {info.size} bytes"


def _open_shm(shm_name: str, size: int) -> int:
    """A descriptor of the shared-memory object itself: not a link to a file elsewhere that
    the engine may write (O_NOFOLLOW, a regular file on the shared-memory filesystem)."""
    path = SHM_ROOT / shm_name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(
            f"shm_name: no shared-memory object {shm_name!r} on the executor's host (a client "
            "on another host cannot register its memory)",
            "shm_name",
        ) from None
    except PermissionError:
        raise FailedPrecondition(
            f"shm_name: the executor may not open {shm_name!r} (its permissions)", "shm_name"
        ) from None
    except OSError as exc:  # ELOOP: a symbolic link
        raise FailedPrecondition(
            f"shm_name: {shm_name!r} is not a shared-memory object ({exc.strerror})", "shm_name"
        ) from None
    try:
        stat = os.fstat(fd)
        if not S_ISREG(stat.st_mode) or stat.st_dev != SHM_ROOT.stat().st_dev:
            raise FailedPrecondition(
                f"shm_name: {shm_name!r} is not a shared-memory object", "shm_name"
            )
        if size <= 0 or size > stat.st_size:
            raise FailedPrecondition(
                f"size: {size} bytes, but {shm_name!r} holds {stat.st_size}; register at most "
                "its size",
                "size",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_cuda(handle: bytes, size: int, device_uuid: str, device: torch.device) -> _CudaMemory:
    own = cuda_ipc.device_uuid(device)
    if device_uuid and device_uuid != own:
        # Another GPU of this host: reachable only over a peer link, which the open below
        # enables (or fails naming why).
        visible = {
            cuda_ipc.device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())
        }
        if device_uuid not in visible:
            raise FailedPrecondition(
                f"device_uuid: {device_uuid} is not a GPU this executor can see (it computes "
                f"on {own}); CUDA memory must be on its GPU or one it reaches by a peer link",
                "device_uuid",
            )
    try:
        pointer = cuda_ipc.open_ipc_handle(handle, device)
    except cuda_ipc.CudaError as exc:
        raise FailedPrecondition(
            f"ipc_handle: the executor cannot map this memory ({exc}); the exporting process "
            "must be alive on this host, and the handle made by cudaIpcGetMemHandle on a "
            "cudaMalloc pointer",
            "ipc_handle",
        ) from None
    # A size past the allocation would let requests read and write beyond it: a fault that
    # takes the engine's context down, not an error for this client.
    actual = cuda_ipc.allocation_size(pointer, device)
    if size > actual:
        cuda_ipc.close_ipc_handle(pointer, device)
        raise FailedPrecondition(
            f"size: {size} bytes, but the exported allocation holds {actual}; register at "
            "most its size",
            "size",
        )
    return _CudaMemory(pointer, size, device)
