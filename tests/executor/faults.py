"""Injected faults for the executor's tests: kernels that fail on cue.

``faulting_kernel`` loses the device context when a launch has ``FAULT_TOKENS`` rows: on a GPU
by a real illegal memory access (a store far past any allocation), on the CPU by raising the
error such an access raises (the CPU has no context to lose; the executor's handling is the
same). ``FAULT_TOKENS`` exceeds the largest CUDA-graph bucket, so the launch runs eagerly and
the kernel function is really called. ``poisoned_kernel`` fails a launch that holds a row
marked with ``POISON``, to show that a merged batch's failure stays the failing request's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from executor_service.batch import KernelFn
from kernels import LoRAContext, MoELayerWeights, Routing, moe_forward
from kernels.forward import Backend

#: A launch of this many rows faults the device.
FAULT_TOKENS = 777
#: A row whose first value is this fails its launch (see ``poisoned_kernel``).
POISON = 1234.5


@triton.jit
def _store_far_away(ptr):  # type: ignore[no-untyped-def]
    tl.store(ptr + (1 << 40), 1.0)


def lose_device_context(device: torch.device) -> None:
    """What an out-of-bounds kernel does to a CUDA context (raises; the context stays lost)."""
    if device.type == "cuda":
        target = torch.zeros(1, device=device)
        _store_far_away[(1,)](target)
        torch.cuda.synchronize(device)
    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def _forward(
    hidden: torch.Tensor, layer: MoELayerWeights, lora: LoRAContext | None, routing: Routing | None
) -> torch.Tensor:
    backend: Backend = "triton" if hidden.is_cuda else "torch"
    return moe_forward(hidden, layer, lora, routing, backend=backend)


def faulting_kernel(
    hidden: torch.Tensor, layer: MoELayerWeights, lora: LoRAContext | None, routing: Routing | None
) -> torch.Tensor:
    if hidden.shape[0] == FAULT_TOKENS:
        lose_device_context(hidden.device)
    return _forward(hidden, layer, lora, routing)


def poisoned_kernel(error: Callable[[], BaseException], launches: list[int]) -> KernelFn:
    """The kernel, raising ``error()`` for a launch that holds a poisoned row; appends each
    launch's row count to ``launches``."""

    def kernel(
        hidden: torch.Tensor,
        layer: MoELayerWeights,
        lora: LoRAContext | None,
        routing: Routing | None,
    ) -> torch.Tensor:
        launches.append(int(hidden.shape[0]))
        if bool((hidden[:, 0] == POISON).any()):
            raise error()
        return _forward(hidden, layer, lora, routing)

    return kernel
