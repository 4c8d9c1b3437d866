"""Where adapter loads run so that serving keeps its speed meanwhile.

Packing, hashing and receiving an adapter are CPU work in the executor's own process; left as
they were, they took both cores of a small machine from Forward (whose torch reference, or whose
launching thread on a GPU, needs them at once). So loads run on threads the executor owns:

* at a lower CPU priority than Forward (``--load-nice``; Linux keeps a nice value per thread,
  and threads a loader thread starts inherit it), so a load takes what serving leaves idle;
* with their own torch intra-op thread count (``--load-threads``), so a pack uses several
  cores of a GPU host but does not crowd a 2-core one. ``torch.set_num_threads`` cannot do
  this: it also sets the count every thread of the process starts with. OpenMP keeps the
  count per thread, so the loader sets its own through ``omp_set_num_threads`` of the
  OpenMP runtime torch loaded (no OpenMP runtime: the process's count);
* at most ``CONCURRENT_PACKS`` packs at once; more wait their turn.

A request that needs a cold adapter waits for its own load only; other requests never wait on it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

#: Adapters packed at the same time; the loads of more wait in a queue.
CONCURRENT_PACKS = 2


#: Load threads of a CUDA executor unless set: the GPU packs, and these threads only read the
#: stored bytes into page-locked staging buffers (pread, one slice each) unless the copy engine
#: reads the page cache itself (--page-cache-dma). Every byte a load copies on the host slows
#: Forward beside it, so the default reads with one. Measured on an H100 host (docs/executor.md,
#: 2026-11-26, unpaced copies, taking turns): 1 thread, disk warm 4.65 and 5.26 GB/s, Forward
#: p50 +21% and +30% during cold loads; 2 threads, 6.82 and 6.52 GB/s, +40% and +25%.
CUDA_LOAD_THREADS = 1


def default_threads(setting: int) -> int:
    """A thread-count setting where 0 means half the CPU cores (at least 1)."""
    return setting or max(1, (os.cpu_count() or 2) // 2)


def load_threads(setting: int, device: torch.device) -> int:
    """``--load-threads``: 0 means ``CUDA_LOAD_THREADS`` on a CUDA executor, half the CPU
    cores on a CPU one (which packs on them)."""
    if setting:
        return setting
    return CUDA_LOAD_THREADS if device.type == "cuda" else default_threads(0)


def lower_priority(nice: int) -> None:
    """Lowers the calling thread's CPU priority by ``nice`` (Linux only: elsewhere the call
    would renice the whole process). A thread cannot raise it again without privileges, so
    only threads that do nothing but load call this."""
    if nice <= 0 or sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + nice))
    except OSError:
        pass  # not permitted here: loads run at serving's priority


def limit_torch_threads(count: int) -> bool:
    """Sets the calling thread's torch intra-op thread count alone (see the module doc);
    False where that cannot be done."""
    runtime = _openmp_runtime()
    if runtime is None:
        return False
    torch.get_num_threads()  # torch initialises this thread's count first, then we change it
    runtime.omp_set_num_threads(ctypes.c_int(count))
    return True


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on, already loaded in this process, if any."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    try:
        with Path("/proc/self/maps").open() as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)  # the loaded library itself: dlopen finds it by path
        except OSError:
            continue
    return None


class Loader:
    """Runs packing on low-priority threads with a bounded torch thread count."""

    def __init__(self, torch_threads: int, nice: int) -> None:
        self.torch_threads = torch_threads
        self.nice = nice
        self._pool = ThreadPoolExecutor(
            CONCURRENT_PACKS, thread_name_prefix="adapter-load", initializer=self._setup
        )

    def _setup(self) -> None:
        lower_priority(self.nice)
        limit_torch_threads(self.torch_threads)

    def run(self, work: Callable[[], T]) -> T:
        """``work()`` on a loader thread; blocks until it returns, raises what it raised."""
        return self._pool.submit(work).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
