"""Whether the driver registers a read-only shared file mapping for a device, tried in a process
of its own: ``python -m executor_service.dma_probe ORDINAL``.

Some platforms answer such a registration with a sticky error (CUDA_ERROR_INVALID_ADDRESS_SPACE
under gVisor's GPU proxy on an H100 host, 2026-11-28) that leaves the calling process's context
unusable, so the serving process may not try it itself. This probe maps one page of a temporary
file, registers it, releases it and synchronizes the context; it exits 0 if all succeeded, and
otherwise prints the failing step and exits 1. Only ctypes: no torch, so it starts in a blink.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import tempfile

_CU_MEMHOSTREGISTER_READ_ONLY = 0x08


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's own C library, with mmap and munmap typed (Python's mmap module does not
    give a read-only map's address)."""
    library = ctypes.CDLL(None, use_errno=True)
    library.mmap.restype = ctypes.c_void_p
    library.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    library.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return library


def probe(ordinal: int) -> str | None:
    """None if a read-only registration of a mapped file works on device ``ordinal``, else the
    step that failed and the driver's error."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver: {exc}"
    driver.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    driver.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    driver.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def failed(result: int, what: str) -> str | None:
        if result == 0:
            return None
        name = ctypes.c_char_p()
        driver.cuGetErrorName(result, ctypes.byref(name))
        return f"{what}: {(name.value or b'CUDA error').decode()} ({result})"

    device, context = ctypes.c_int(), ctypes.c_void_p()
    if reason := failed(driver.cuInit(0), "initializing the driver"):
        return reason
    if reason := failed(driver.cuDeviceGet(ctypes.byref(device), ordinal), f"device {ordinal}"):
        return reason
    retained = driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    if reason := failed(retained, "retaining the primary context"):
        return reason
    if reason := failed(driver.cuCtxSetCurrent(context), "making the primary context current"):
        return reason
    with tempfile.TemporaryFile() as file:
        file.write(b"\0" * mmap.PAGESIZE)
        file.flush()
        address = libc().mmap(
            None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), 0
        )
        if address in (None, ctypes.c_void_p(-1).value):
            return f"mapping a file: errno {ctypes.get_errno()}"
        registered = driver.cuMemHostRegister_v2(
            address, mmap.PAGESIZE, _CU_MEMHOSTREGISTER_READ_ONLY
        )
        if reason := failed(registered, "registering a mapped page read-only"):
            return reason
        return failed(driver.cuMemHostUnregister(address), "releasing it") or failed(
            driver.cuCtxSynchronize(), "synchronizing the context after it"
        )


def main() -> None:
    reason = probe(int(sys.argv[1]))
    if reason is not None:
        print(reason)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
