"""Builds ``kernels.hopper_w2``'s kernel for sm_90 on a machine without a GPU, as
``w2_stage_hopper`` launches it, and prints its PTX and SASS as JSON.

A process of its own: the test process runs Triton's interpreter (``TRITON_INTERPRET``), under
which the ``tl`` functions Gluon calls cannot be compiled.

    python -m tests.kernels.sm90_build
"""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels import hopper_w2

_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _descriptor_signature(dtype: torch.dtype, block: list[int]) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL[dtype])
    return f"tensordesc<{_SIG[dtype]}[{block[0]}, {block[1]}],{layout!r}>"


def build(dtype: torch.dtype, has_lora: bool, atomic_sum: bool, rp: int) -> dict[str, object]:
    """The kernel as ``w2_stage_hopper`` launches it, compiled for sm_90 without a GPU: its
    PTX, SASS and shared memory in bytes."""
    w = hopper_w2
    element = _SIG[dtype]
    signature = {
        "act_desc": _descriptor_signature(dtype, [w.BLOCK_M, w.BLOCK_K]),
        "w_desc": _descriptor_signature(dtype, [w.BLOCK_N, w.BLOCK_K]),
        "xa_ptr": f"*{element}",
        "b_ptr": f"*{element}",
        "bias_ptr": f"*{element}",
        "out_ptr": "*fp32" if atomic_sum else f"*{element}",
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
    constants = {
        "HAS_BIAS": True,
        "HAS_LORA": has_lora,
        "ATOMIC_SUM": atomic_sum,
        "RP": rp,
        "STAGES": w.NUM_BUFFERS,
        "LOADER_WARPS": w.LOADER_WARPS,
        "LOADER_REGISTERS": w.LOADER_REGISTERS,
        "num_warps": w.NUM_WARPS,
    }
    signature |= dict.fromkeys(constants, "constexpr")
    names = list(signature)
    source = gluon._runtime.GluonASTSource(
        w._w2_hopper_kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": w.NUM_WARPS}
    )
    return {
        "ptx": compiled.asm["ptx"],
        "sass": compiled.asm["sass"],
        "shared": compiled.metadata.shared,
    }


def variant(dtype: str, lora: bool, atomic_sum: bool, rp: int) -> str:
    return f"{dtype} lora={int(lora)} atomic_sum={int(atomic_sum)} rp={rp}"


def main() -> None:
    """Every variant the tests check, by ``variant``'s name: each dtype with and without LoRA
    and the atomic sum at rank 16, and the largest rank it takes."""
    cases = [
        (dtype, lora, atomic, 16)
        for dtype in ("bfloat16", "float16")
        for lora in (False, True)
        for atomic in (False, True)
    ]
    cases.append(("bfloat16", True, False, hopper_w2.MAX_RANK))
    built = {
        variant(dtype, lora, atomic, rp): build(getattr(torch, dtype), lora, atomic, rp)
        for dtype, lora, atomic, rp in cases
    }
    print(json.dumps(built))


if __name__ == "__main__":
    main()
