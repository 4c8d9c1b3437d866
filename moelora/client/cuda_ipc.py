"""CUDA IPC through the CUDA runtime that torch loaded: device memory one process allocates and
another on the same host maps, named by a 64-byte ``cudaIpcMemHandle_t``.

A client allocates its buffer with ``DeviceBuffer`` (plain ``cudaMalloc``: memory from torch's
caching allocator may sit inside a larger block, and ``expandable_segments`` memory cannot be
exported this way at all), sends ``DeviceBuffer.ipc_handle`` to the executor once, and the
executor maps it with ``open_ipc_handle``. Both sides see the same bytes; what orders their
reads and writes is the caller's (the Forward protocol: the client's writes are complete before
it sends a request, the executor's before it answers).

A C++ or Rust client makes the same handle with ``cudaIpcGetMemHandle`` on a ``cudaMalloc``
pointer. Opening a handle costs about a millisecond, so the executor opens each once, at
registration. A handle cannot be opened in the process that made it.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Bytes of a ``cudaIpcMemHandle_t``.
HANDLE_BYTES = 64
#: ``cudaIpcMemLazyEnablePeerAccess``: memory of another GPU is reached over its peer link.
_LAZY_PEER_ACCESS = 1


class CudaError(RuntimeError):
    """A CUDA runtime call failed (its error name and text in the message)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch uses (one runtime per process keeps one context per device)."""
    import torch

    torch.cuda.init()  # type: ignore[no-untyped-call]
    path = _loaded_cudart()
    if path is None:
        raise CudaError("the CUDA runtime (libcudart) is not loaded in this process")
    lib = ctypes.CDLL(path)
    lib.cudaGetErrorName.restype = ctypes.c_char_p
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_void_p]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaHostGetDevicePointer.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
        ctypes.c_uint,
    ]
    return lib


def _loaded_cudart() -> str | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "libcudart.so" in Path(path).name:
            return path
    return None


def _check(code: int, what: str) -> None:
    if code == 0:
        return
    lib = _cudart()
    lib.cudaGetLastError()  # a failed call leaves its error for the next check: clear it
    name = lib.cudaGetErrorName(code).decode()
    text = lib.cudaGetErrorString(code).decode()
    raise CudaError(f"{what}: {name} ({text})")


class DeviceBuffer:
    """``nbytes`` of device memory from ``cudaMalloc`` on ``device``, exportable by CUDA IPC;
    freed by ``close``. ``tensor`` views it as uint8."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        import torch

        if nbytes < 1:
            raise ValueError("nbytes must be at least 1")
        self.nbytes = nbytes
        self.device = device
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(_cudart().cudaMalloc(ctypes.byref(pointer), nbytes), "cudaMalloc")
        assert pointer.value is not None
        self.pointer: int = pointer.value
        self.tensor = device_tensor(self.pointer, nbytes)
        self._lock = threading.Lock()

    @property
    def ipc_handle(self) -> bytes:
        handle = _Handle()
        with _device(self.device):
            _check(_cudart().cudaIpcGetMemHandle(ctypes.byref(handle), self.pointer), "handle")
        return bytes(handle)  # not handle.reserved: a c_char array stops at the first zero

    def close(self) -> None:
        """Frees the memory (views of ``tensor`` must be gone). Idempotent."""
        with self._lock:
            if not self.pointer:
                return
            self.tensor = None  # type: ignore[assignment]
            with _device(self.device):
                _check(_cudart().cudaFree(self.pointer), "cudaFree")
            self.pointer = 0


def open_ipc_handle(handle: bytes, device: torch.device) -> int:
    """Maps another process's exported memory into this one (current device ``device``);
    returns its address. CudaError if it cannot (a stale handle, a GPU without a peer link)."""
    if len(handle) != HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, not {len(handle)}")
    raw = _Handle.from_buffer_copy(handle)
    pointer = ctypes.c_void_p()
    with _device(device):
        _check(
            _cudart().cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _LAZY_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
    assert pointer.value is not None
    return pointer.value


#: ``cudaHostRegisterPortable | cudaHostRegisterMapped``: every context reaches the memory,
#: through a device address.
_HOST_REGISTER = 1 | 2


def register_host(pointer: int, nbytes: int, device: torch.device) -> None:
    """Page-locks ``nbytes`` of host memory at ``pointer`` so that kernels on ``device`` read
    and write it in place at the same address. CudaError if it cannot be registered, or if
    the device would need another address for it (no ``canUseHostPointerForRegisteredMem``):
    callers pass host addresses to kernels."""
    lib = _cudart()
    with _device(device):
        _check(lib.cudaHostRegister(pointer, nbytes, _HOST_REGISTER), "cudaHostRegister")
        mapped = ctypes.c_void_p()
        code = lib.cudaHostGetDevicePointer(ctypes.byref(mapped), pointer, 0)
        if code != 0 or mapped.value != pointer:
            lib.cudaHostUnregister(pointer)
            _check(code, "cudaHostGetDevicePointer")
            raise CudaError("registered host memory has another address on the device")


def unregister_host(pointer: int, device: torch.device) -> None:
    """Ends ``register_host`` (no kernel may still use the memory)."""
    with _device(device):
        _check(_cudart().cudaHostUnregister(pointer), "cudaHostUnregister")


def allocation_size(pointer: int, device: torch.device) -> int:
    """Bytes of the allocation that ``pointer`` starts (``cuMemGetAddressRange``)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with _device(device):
        code = _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer)
    if code != 0:
        raise CudaError(f"cuMemGetAddressRange: error {code}")
    return int(size.value) - (pointer - int(base.value))


@cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    return lib


def close_ipc_handle(pointer: int, device: torch.device) -> None:
    with _device(device):
        _check(_cudart().cudaIpcCloseMemHandle(pointer), "cudaIpcCloseMemHandle")


class _DeviceBytes:
    """Device memory described by the CUDA array interface, which torch reads zero-copy."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 2,
        }


def device_tensor(pointer: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at device address ``pointer`` (its GPU the one the
    memory lives on); it does not own the memory."""
    import torch

    return torch.as_tensor(_DeviceBytes(pointer, nbytes))


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID as ``nvidia-smi -L`` prints it ("GPU-…"): the same in every process,
    whatever ``CUDA_VISIBLE_DEVICES`` numbers it."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def _device(device: torch.device) -> torch.cuda.device:
    import torch

    return torch.cuda.device(device)
