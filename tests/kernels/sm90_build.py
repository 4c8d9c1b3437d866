"""Builds the Hopper Gluon kernels (``kernels.hopper_w13``, ``kernels.hopper_w2``) for sm_90 on
a machine without a GPU, from the arguments their launchers build, and prints each
variant's PTX, SASS and shared memory as JSON.

A process of its own: the test process runs Triton's interpreter (``TRITON_INTERPRET``), under
which the ``tl`` functions Gluon calls cannot be compiled.

    python -m tests.kernels.sm90_build
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental import gluon
from triton.runtime.jit import create_function_from_signature

from kernels import hopper_gemm, hopper_w2, hopper_w13
from kernels.align import Alignment
from kernels.types import FP8_BLOCK, FP8_DTYPE, Activation

_TARGET = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True)
class Variant:
    """One build: which kernel, its operand dtype, LoRA and padded rank, and its own switch
    (w2: the atomic sum over k; w13: the GPT-OSS activation instead of SiLU)."""

    kernel: str  # "w13" or "w2"
    dtype: str  # "bfloat16" or "float16": the hidden states'
    lora: bool
    switch: bool
    rp: int = 16
    fp8: bool = False  # FP8 weights and inputs (W8A8)
    pingpong: bool = False  # the compute warpgroups taking turns (GemmConfig.pingpong)

    @property
    def name(self) -> str:
        flags = f"lora={int(self.lora)} switch={int(self.switch)} rp={self.rp}"
        kind = " fp8" if self.fp8 else " pingpong" if self.pingpong else ""
        return f"{self.kernel} {self.dtype}{kind} {flags}"


VARIANTS = [
    Variant(kernel, dtype, lora, switch)
    for kernel in ("w13", "w2")
    for dtype in ("bfloat16", "float16")
    for lora in (False, True)
    for switch in (False, True)
] + [Variant(kernel, "bfloat16", True, False, hopper_gemm.MAX_RANK) for kernel in ("w13", "w2")]
VARIANTS += [
    Variant(kernel, "bfloat16", lora, switch, rp, fp8=True)
    for kernel in ("w13", "w2")
    for lora, switch, rp in (
        (False, False, 16),
        (True, False, 16),
        (True, True, 16),
        (True, False, hopper_gemm.MAX_RANK),
    )
]
VARIANTS += [
    Variant(kernel, "bfloat16", lora, switch, rp, pingpong=True)
    for kernel in ("w13", "w2")
    for lora, switch, rp in (
        (False, False, 16),
        (True, False, 16),
        (True, True, 16),
        (True, True, hopper_gemm.MAX_RANK),
    )
]


#: The operands' sizes: experts, hidden, intermediate, adapter slots, blocks of aligned rows.
_E, _H, _I, _S, _BLOCKS = 4, 512, 256, 3, 2


def _launch(dtype: torch.dtype, v: Variant) -> hopper_gemm.KernelLaunch:
    """The variant's launch, built by its stage's own launcher on CPU tensors."""
    rows = _BLOCKS * hopper_gemm.BLOCK_M
    alignment = Alignment(
        sorted_pair_ids=torch.zeros(rows, dtype=torch.int32),
        row_slots=None,
        block_experts=torch.zeros(_BLOCKS, dtype=torch.int32),
        block_m=hopper_gemm.BLOCK_M,
    )
    n = 2 * _I if v.kernel == "w13" else _H
    lora = (
        torch.zeros(rows, v.rp, dtype=dtype),
        torch.zeros(_S, _E, n, v.rp, dtype=dtype),
        torch.zeros(rows, dtype=torch.int32),
    )
    xa, lora_b, row_slots = lora if v.lora else (None, None, None)
    operand = FP8_DTYPE if v.fp8 else dtype
    k = _H if v.kernel == "w13" else _I
    x = torch.zeros(rows, k, dtype=operand)
    w = torch.zeros(_E, n, k, dtype=operand)
    x_scale = torch.ones(rows, -(-k // FP8_BLOCK)) if v.fp8 else None
    w_scale = torch.ones(_E, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)) if v.fp8 else None
    if v.kernel == "w13":
        activation = Activation.GPT_OSS if v.switch else Activation.SILU
        return hopper_w13.w13_launch(
            x, w, torch.zeros(_E, 2 * _I, dtype=dtype), activation, 1.702, 7.0, alignment,
            xa, lora_b, row_slots, torch.zeros(rows, _I, dtype=dtype), x_scale, w_scale,
            v.pingpong,
        )  # fmt: skip
    top_k, tokens = 2, 64
    out_rows, out_dtype = (tokens, torch.float32) if v.switch else (tokens * top_k, dtype)
    return hopper_w2.w2_launch(
        x, w, torch.zeros(_E, _H, dtype=dtype), torch.zeros(tokens, top_k), alignment,
        xa, lora_b, row_slots, v.switch, torch.zeros(out_rows, _H, dtype=out_dtype),
        x_scale, w_scale, v.pingpong,
    )  # fmt: skip


def build(v: Variant) -> dict[str, Any]:
    """Variant ``v`` compiled for sm_90 as Triton's launcher would compile it (its binder
    specialises the arguments: an int equal to 1 becomes a constexpr, pointers and ints get
    their divisibility): its PTX, SASS and shared memory in bytes."""
    launch = _launch(getattr(torch, v.dtype), v)
    kernel = launch.kernel
    backend = make_backend(_TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    source = gluon._runtime.GluonASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=_TARGET, options=options.__dict__)
    return {
        "ptx": compiled.asm["ptx"],
        "sass": compiled.asm["sass"],
        "shared": compiled.metadata.shared,
    }


def main() -> None:
    print(json.dumps({v.name: build(v) for v in VARIANTS}))


if __name__ == "__main__":
    main()
