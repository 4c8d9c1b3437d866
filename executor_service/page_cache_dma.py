"""Where a file's pages in the OS page cache are lent to a CUDA device, so that a host→device
copy reads them where they lie.

Staged, each byte of an adapter file is first copied by the CPU from the page cache into a
page-locked buffer (pread), and the copy engine reads it from there. That host copy bounds the
load and costs Forward beside it, since it takes the memory bandwidth and the caches serving
shares. Registered instead, the pages of a read-only shared mapping of the file are pinned in
place, a window at a time, and the copy engine reads them directly. Measured on an H100 host
(a 1.26 GB file in the page cache, 4 MiB copies one in flight, 3 runs): pread staging 5.9–6.3
GB/s and 0.22 CPU seconds; windows of 64 MiB registered 14.5–15.9 GB/s and 0.06 CPU seconds
(0.04 of them registering); windows of 4 MiB 10–13 GB/s.

Registration is the driver's ``cuMemHostRegister`` with the read-only flag, called through
ctypes on ``libcuda.so.1`` (the driver's stable C ABI): a call that fails there leaves no error
behind for the runtime's next launch check on this thread to raise, as ``cudaHostRegister``
through torch would. It needs the device to support read-only registration (an H100 host does;
vllm-omni found a B300 that does not): registering a private mapping writable instead would
make copy-on-write copy every page. And it needs the platform to register file mappings at all:
under gVisor's GPU proxy the driver answers with a sticky CUDA_ERROR_INVALID_ADDRESS_SPACE that
ends the process's context, so a child process tries it first, once per device (dma_probe.py).
Where it is not supported ``open_for_dma`` gives None, and where one registration fails the
caller stages the bytes instead.

Off by default (``--page-cache-dma``): with the copies unpaced, one per 64 MiB window, disk-warm
loads ran at 7.7–9.7 GB/s against 3.4–5.4 staged, but Forward's p50 beside them rose +55% to +77%
against +7% to +17% staged, for a cause not known
(docs/decisions/0004-page-cache-dma-off-by-default.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.dma_probe import libc

#: Bytes registered at a time: registering costs a fixed part per call, and a window's pages
#: stay pinned until its last copy is done (see the module doc for what sizes measured).
WINDOW_BYTES = 64 << 20

_PAGE = mmap.PAGESIZE

# From cuda.h.
_CUDA_SUCCESS = 0
_CU_MEMHOSTREGISTER_READ_ONLY = 0x08
_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113


class RegisterError(RuntimeError):
    """The driver would not register (or release) a range of a mapped file."""


@dataclass(frozen=True)
class Window:
    """Registered whole pages of a mapped file: file bytes [offset, offset + size), which
    lie at ``address``."""

    address: int
    offset: int
    size: int

    def tensor(self, begin: int, end: int) -> torch.Tensor:
        """File bytes [begin, end) as a CPU uint8 tensor over the registered pages (read
        them only: the mapping is read-only)."""
        if not self.offset <= begin <= end <= self.offset + self.size:
            raise ValueError(
                f"bytes [{begin}, {end}) lie outside the window "
                f"[{self.offset}, {self.offset + self.size})"
            )
        count = end - begin
        if not count:
            return torch.empty(0, dtype=torch.uint8)
        memory = (ctypes.c_char * count).from_address(self.address + begin - self.offset)
        return torch.frombuffer(memory, dtype=torch.uint8)


class MappedFile:
    """A file mapped read-only and shared, whose pages are registered a window at a time
    for the CUDA device ``ordinal``. Python's mmap does not give a read-only map's address,
    so libc maps it."""

    def __init__(self, path: Path, ordinal: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._length = -(-self.size // _PAGE) * _PAGE
            address = libc().mmap(None, self._length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)  # the mapping keeps the file
        if address in (None, ctypes.c_void_p(-1).value):  # MAP_FAILED
            error = ctypes.get_errno()
            raise OSError(error, f"cannot map {path}: {os.strerror(error)}")
        self._address: int = address
        try:
            self._context = _PrimaryContext(ordinal)
        except RegisterError:
            libc().munmap(self._address, self._length)
            raise
        self._windows: set[int] = set()

    def register(self, begin: int, end: int) -> Window:
        """Registers the whole pages holding file bytes [begin, end) (0 ≤ begin < end ≤ size)
        with the device's primary context (torch's); raises RegisterError where the driver
        declines."""
        if not 0 <= begin < end <= self.size:
            raise ValueError(f"bytes [{begin}, {end}) of a {self.size}-byte file")
        self._context.make_current()
        first = begin // _PAGE * _PAGE
        size = min(-(-end // _PAGE) * _PAGE, self._length) - first
        address = self._address + first
        _check(
            _driver().cuMemHostRegister_v2(address, size, _CU_MEMHOSTREGISTER_READ_ONLY),
            f"registering {size} bytes of a mapped file",
        )
        self._windows.add(address)
        return Window(address, first, size)

    def release(self, window: Window) -> None:
        """Unregisters a window; no copy from it may still be running."""
        self._unregister(window.address)

    def _unregister(self, address: int) -> None:
        self._windows.remove(address)
        _check(_driver().cuMemHostUnregister(address), "releasing a registered window")

    def close(self) -> None:
        """Releases what is still registered and unmaps the file."""
        for address in list(self._windows):
            with contextlib.suppress(RegisterError):
                self._unregister(address)
        libc().munmap(self._address, self._length)
        self._context.release()


@contextlib.contextmanager
def open_for_dma(path: Path | None, device: torch.device) -> Iterator[MappedFile | None]:
    """``path`` mapped for registration while the context lasts, or None: no path, an empty
    file, a device that is not CUDA, or one without read-only registration."""
    if (
        path is None
        or device.type != "cuda"
        or not path.stat().st_size
        or registration_declined(device) is not None
    ):
        yield None
        return
    mapped = MappedFile(path, _ordinal(device))
    try:
        yield mapped
    finally:
        mapped.close()


def registration_declined(device: torch.device) -> str | None:
    """Why the driver would not register read-only file mappings for ``device`` (the device's
    attribute, then a try in a child process), or None where it does."""
    return _declined(_ordinal(device))


def _ordinal(device: torch.device) -> int:
    """A CUDA device's index ("cuda" alone: the current one)."""
    with torch.cuda.device(device):
        return torch.cuda.current_device()


@functools.cache
def _declined(ordinal: int) -> str | None:
    driver = _driver_or_none()
    if driver is None:
        return "the CUDA driver library (libcuda.so.1) is not available"
    handle = ctypes.c_int()
    value = ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(handle), ordinal) != _CUDA_SUCCESS:
        return f"no CUDA device {ordinal}"
    result = driver.cuDeviceGetAttribute(
        ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, handle
    )
    if result != _CUDA_SUCCESS or value.value != 1:
        return f"device {ordinal} does not support read-only host registration"
    return _probe_declines(ordinal)


def _probe_declines(ordinal: int) -> str | None:
    """Why a registration of a mapped file fails on the device, tried in a child process
    (dma_probe.py: some platforms fail it with a sticky error); None if it works."""
    try:
        probe = subprocess.run(
            [sys.executable, "-m", "executor_service.dma_probe", str(ordinal)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the registration probe did not run: {exc}"
    if probe.returncode == 0:
        return None
    return probe.stdout.strip() or f"the registration probe exited {probe.returncode}"


class _PrimaryContext:
    """The device's primary context, the one torch's runtime runs in, retained while a mapped
    file may register pages with it (torch may not have created it yet: a retain does)."""

    def __init__(self, ordinal: int) -> None:
        driver = _driver()
        self._device = ctypes.c_int()
        _check(driver.cuDeviceGet(ctypes.byref(self._device), ordinal), f"CUDA device {ordinal}")
        self._context = ctypes.c_void_p()
        _check(
            driver.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), self._device),
            "retaining the primary context",
        )

    def make_current(self) -> None:
        """Makes it current on the calling thread: a thread that has only reused memory torch
        had cached may have made no runtime call that binds it yet (the driver API would
        then answer CUDA_ERROR_INVALID_CONTEXT)."""
        driver = _driver()
        current = ctypes.c_void_p()
        _check(driver.cuCtxGetCurrent(ctypes.byref(current)), "reading the current context")
        if current.value != self._context.value:
            _check(driver.cuCtxSetCurrent(self._context), "making the primary context current")

    def release(self) -> None:
        _driver().cuDevicePrimaryCtxRelease_v2(self._device)


def _check(result: int, what: str) -> None:
    if result == _CUDA_SUCCESS:
        return
    name = ctypes.c_char_p()
    _driver().cuGetErrorName(result, ctypes.byref(name))
    raise RegisterError(f"{what}: {(name.value or b'CUDA error').decode()} ({result})")


def _driver() -> ctypes.CDLL:
    driver = _driver_or_none()
    if driver is None:
        raise RegisterError("the CUDA driver library (libcuda.so.1) is not available")
    return driver


@functools.cache
def _driver_or_none() -> ctypes.CDLL | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    driver.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    driver.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    driver.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    driver.cuDeviceGetAttribute.argtypes = [
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_int,
        ctypes.c_int,
    ]
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    driver.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    driver.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    driver.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    driver.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    return driver
