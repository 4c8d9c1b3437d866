"""Activations quantised to FP8 for the FP8 tensor cores: a float32 scale per row and 128
columns (DeepSeek-V3's ``act_quant``, the "1×128 groups" its FP8 GEMMs take beside 128×128
weight blocks).

``quantize_activations_reference`` is the torch form; ``quantize_activations`` the Triton
kernel, equal to it value for value (both divide in IEEE float32, ``tl.math.div_rn``, and
round to nearest, ties to even; a negative that rounds to zero may come out +0). A group's
largest magnitude maps to e4m3's largest value, an all-zero group gets scale 1, as
``kernels.fp8.quantize`` does for weight blocks.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.types import FP8_BLOCK, FP8_DTYPE

_FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
_ROWS_PER_PROGRAM = 16


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) → (q (M, K) float8_e4m3fn, scale (M, ceil(K/128)) float32), computed in
    float32: x ≈ q · scale[:, k // 128]."""
    rows, columns = x.shape
    pad = -columns % FP8_BLOCK
    groups = torch.nn.functional.pad(x.float(), (0, pad)).reshape(rows, -1, FP8_BLOCK)
    amax = groups.abs().amax(dim=-1)
    # A tensor divisor: torch on CUDA multiplies by the reciprocal of a scalar one.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, _FP8_MAX), torch.ones_like(amax))
    q = (groups / scale[:, :, None]).reshape(rows, -1)[:, :columns].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def dequantize_activations(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """What quantised activations stand for, in ``dtype`` (the references' input)."""
    full = scale.to(dtype).repeat_interleave(FP8_BLOCK, dim=1)[:, : q.shape[1]]
    return q.to(dtype) * full


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| ≤ 448) rounded to the nearest e4m3 value, ties to even, still in
    float32 — so that the conversion after it is exact (Triton's interpreter does not carry a
    rounded-up mantissa into the exponent; the GPU's conversion would give the same)."""
    exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # e4m3 keeps 3 mantissa bits down to 2^-6, then steps of 2^-9 (subnormals).
    step_exponent = tl.maximum(exponent - 127, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    per_step = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)  # 1 / step, exact
    magic = 12582912.0  # 1.5 · 2^23: adding and subtracting it rounds to an integer, ties even
    return ((v * per_step + magic) - magic) * step


@triton.jit
def _quantize_kernel(
    x_ptr,  # (M, K) bf16 / fp16 / fp32
    q_ptr,  # (M, K) float8_e4m3fn
    scale_ptr,  # (M, ceil(K/128)) float32
    M,
    K,
    stride_x,
    stride_q,
    stride_s,
    FP8_MAX: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One program per ROWS rows and one 128-column group."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    largest = tl.full(amax.shape, FP8_MAX, tl.float32)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, largest), 1.0)
    q = _round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))
    tl.store(
        q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask
    )
    tl.store(scale_ptr + rows64 * stride_s + group, scale, mask=row_ok)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``quantize_activations_reference``, in one Triton launch. x (M, K), contiguous rows."""
    rows, columns = x.shape
    groups = triton.cdiv(columns, FP8_BLOCK)
    q = torch.empty((rows, columns), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(triton.cdiv(rows, _ROWS_PER_PROGRAM), groups)](
            x, q, scale, rows, columns, x.stride(0), q.stride(0), scale.stride(0),
            FP8_MAX=_FP8_MAX, ROWS=_ROWS_PER_PROGRAM, GROUP=FP8_BLOCK,
        )  # fmt: skip
    return q, scale
