"""Process-wide settings of an executor, applied once before it starts (``moelora-executor``
and the benchmarks that host an executor in their own process): what the interpreter and
torch's allocators take from the process, not from one executor object."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import MutableMapping

from executor_service.config import ExecutorSettings

#: Page-locked host memory (the packed adapters of the host cache, staging buffers) through
#: malloc and cudaHostRegister, 8 threads mapping the pages, instead of cudaHostAlloc. Measured
#: on an H100 host: fresh page-locked memory 1.63 → 4.89 GB/s, so a cold load, which packs
#: into fresh memory, 1.0 → 1.7 GB/s (docs/executor.md). torch reads it at its first
#: page-locked allocation.
PINNED_ALLOCATOR = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def configure_process(
    settings: ExecutorSettings, environ: MutableMapping[str, str] = os.environ
) -> None:
    """Applies the process-wide settings; call before the first CUDA allocation."""
    # The launch loop gives up the GIL in device waits and must win it back from the other
    # threads (front-end readers, loads): a short switch interval bounds that wait.
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    raise_open_files_limit()
    current = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_" not in current:  # an operator's own page-locked settings win
        environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, PINNED_ALLOCATOR]))


def raise_open_files_limit() -> None:
    """Lifts the soft limit on open files to the hard one: each client's registered
    shared-memory region holds a descriptor (up to 64 per token, ``serving/regions.py``), and
    a default soft limit of 1,024 would let a handful of tokens leave the engine none for
    its sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # a sandbox may refuse: keep the soft
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
