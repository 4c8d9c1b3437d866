"""Builds the Hopper Gluon kernels (``kernels.hopper_w13``, ``kernels.hopper_w2``) for sm_90 on
a machine without a GPU, as their launchers launch them, and prints each variant's PTX, SASS
and shared memory as JSON.

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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels import hopper_gemm, hopper_w2, hopper_w13

_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Variant:
    """One build: which kernel, its operand dtype, LoRA and padded rank, and its own switch
    (w2: the atomic sum over k; w13: the GPT-OSS activation instead of SiLU)."""

    kernel: str  # "w13" or "w2"
    dtype: str  # "bfloat16" or "float16"
    lora: bool
    switch: bool
    rp: int = 16

    @property
    def name(self) -> str:
        flags = f"lora={int(self.lora)} switch={int(self.switch)} rp={self.rp}"
        return f"{self.kernel} {self.dtype} {flags}"


VARIANTS = [
    Variant(kernel, dtype, lora, switch)
    for kernel in ("w13", "w2")
    for dtype in ("bfloat16", "float16")
    for lora in (False, True)
    for switch in (False, True)
] + [Variant(kernel, "bfloat16", True, False, hopper_gemm.MAX_RANK) for kernel in ("w13", "w2")]


def _descriptor(dtype: torch.dtype, block: list[int]) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL[dtype])
    return f"tensordesc<{_SIG[dtype]}[{block[0]}, {block[1]}],{layout!r}>"


def _w2(dtype: torch.dtype, v: Variant) -> tuple[Any, dict[str, str], dict[str, Any]]:
    element = _SIG[dtype]
    signature = {
        "act_desc": _descriptor(dtype, [hopper_gemm.BLOCK_M, hopper_gemm.BLOCK_K]),
        "w_desc": _descriptor(dtype, [hopper_w2.BLOCK_N, hopper_gemm.BLOCK_K]),
        "xa_ptr": f"*{element}",
        "b_ptr": f"*{element}",
        "bias_ptr": f"*{element}",
        "out_ptr": "*fp32" if v.switch else f"*{element}",
        "pair_ids_ptr": "*i32",
        "row_slots_ptr": "*i32",
        "block_experts_ptr": "*i32",
        "topk_weights_ptr": "*fp32",
    }
    for name in (
        "num_blocks", "H", "inter", "top_k", "R", "stride_xa", "stride_bs", "stride_be",
        "stride_bn", "stride_br", "stride_bias", "stride_out",
    ):  # fmt: skip
        signature[name] = "i32"
    constants = {"HAS_BIAS": True, "HAS_LORA": v.lora, "ATOMIC_SUM": v.switch}
    return hopper_w2._w2_hopper_kernel, signature, constants


def _w13(dtype: torch.dtype, v: Variant) -> tuple[Any, dict[str, str], dict[str, Any]]:
    element = _SIG[dtype]
    signature = {
        "x_desc": _descriptor(dtype, [hopper_gemm.BLOCK_M, hopper_gemm.BLOCK_K]),
        "w_desc": _descriptor(dtype, [hopper_w13.BLOCK_I, hopper_gemm.BLOCK_K]),
        "xa_ptr": f"*{element}",
        "b_ptr": f"*{element}",
        "bias_ptr": f"*{element}",
        "out_ptr": f"*{element}",
        "row_slots_ptr": "*i32",
        "block_experts_ptr": "*i32",
        "num_blocks": "i32",
        "H": "i32",
        "inter": "i32",
        "R": "i32",
        "alpha": "fp32",
        "limit": "fp32",
    }
    for name in (
        "stride_xa", "stride_bs", "stride_be", "stride_bn", "stride_br", "stride_bias",
        "stride_out",
    ):  # fmt: skip
        signature[name] = "i32"
    constants = {"ACTIVATION": int(v.switch), "HAS_BIAS": True, "HAS_LORA": v.lora}
    return hopper_w13._w13_hopper_kernel, signature, constants


def build(v: Variant) -> dict[str, Any]:
    """Variant ``v`` compiled for sm_90: its PTX, SASS and shared memory in bytes."""
    dtype = getattr(torch, v.dtype)
    kernel, signature, constants = (_w13 if v.kernel == "w13" else _w2)(dtype, v)
    constants |= {
        "RP": v.rp,
        "STAGES": hopper_gemm.NUM_BUFFERS,
        "LOADER_WARPS": hopper_gemm.LOADER_WARPS,
        "LOADER_REGISTERS": hopper_gemm.LOADER_REGISTERS,
        "num_warps": hopper_gemm.NUM_WARPS,
    }
    signature |= dict.fromkeys(constants, "constexpr")
    names = list(signature)
    source = gluon._runtime.GluonASTSource(
        kernel,
        signature=signature,
        constexprs={(names.index(k),): value for k, value in constants.items()},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": hopper_gemm.NUM_WARPS}
    )
    return {
        "ptx": compiled.asm["ptx"],
        "sass": compiled.asm["sass"],
        "shared": compiled.metadata.shared,
    }


def main() -> None:
    print(json.dumps({v.name: build(v) for v in VARIANTS}))


if __name__ == "__main__":
    main()
