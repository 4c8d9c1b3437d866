"""FP8 expert weights with 128×128 block scales, as DeepSeek-V3/R1 and Qwen3 "-FP8" ship them.

A weight W (N, K) is stored as ``q`` (N, K) float8_e4m3fn and ``scale`` (ceil(N/128),
ceil(K/128)) float32 (the checkpoints' ``weight_scale_inv``): ``W[n, k] ≈ q[n, k] ·
scale[n // 128, k // 128]``. Leading dimensions (experts) broadcast. These are the plain torch
forms that the references, the loader's checks and the synthetic checkpoints use; the Triton
kernels apply the same scales inside their main loops (``kernels.fused_moe``).
"""

from __future__ import annotations

import torch

from kernels.types import FP8_BLOCK, FP8_DTYPE

#: Largest finite float8_e4m3fn value: a block's largest magnitude maps to it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def expand_scales(scale: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """(..., ceil(rows/128), ceil(columns/128)) → (..., rows, columns), each scale repeated
    over its block."""
    full = scale.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return full[..., :rows, :columns]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 tensor stands for, computed in float32 and returned in ``dtype``."""
    rows, columns = q.shape[-2], q.shape[-1]
    return (q.float() * expand_scales(scale.float(), rows, columns)).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, N, K) → (q, scale): each 128×128 block scaled so that its largest magnitude maps to
    FP8_MAX (DeepSeek's ``weight_dequant`` inverts exactly this). An all-zero block gets
    scale 1."""
    rows, columns = weight.shape[-2], weight.shape[-1]
    pad_rows, pad_cols = -rows % FP8_BLOCK, -columns % FP8_BLOCK
    padded = torch.nn.functional.pad(weight.float(), (0, pad_cols, 0, pad_rows))
    lead = padded.shape[:-2]
    blocks = padded.reshape(
        *lead, padded.shape[-2] // FP8_BLOCK, FP8_BLOCK, padded.shape[-1] // FP8_BLOCK, FP8_BLOCK
    )
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (weight.float() / expand_scales(scale, rows, columns)).to(FP8_DTYPE)
    return q, scale.contiguous()
