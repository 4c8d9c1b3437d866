"""The always-on shared expert (qwen2_moe, deepseek_v3), computed by torch.

Both paths call this: the Triton path in the hidden states' dtype (its output is added to the
routed sum before the one final rounding), the reference in float32 or float64. It is a dense
MLP over all tokens, so cuBLAS is the right tool for it; nothing here is an oracle. On the CPU
the products run in fixed row blocks (``kernels.row_blocks``), so a token's result does not
depend on the batch it was merged into.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.row_blocks import linear
from kernels.types import SharedExpertWeights


def shared_expert_forward(
    hidden: torch.Tensor, shared: SharedExpertWeights, compute_dtype: torch.dtype
) -> torch.Tensor:
    """silu(gate)·up MLP of ``hidden`` (T, H) in ``compute_dtype``, optionally scaled by
    sigmoid(x·gateᵀ); returns (T, H) in ``compute_dtype``."""
    x = hidden.to(compute_dtype)
    gate, up = linear(x, shared.w13.to(compute_dtype)).chunk(2, dim=-1)
    y = linear(F.silu(gate) * up, shared.w2.to(compute_dtype))
    if shared.gate is not None:
        y = y * torch.sigmoid(linear(x, shared.gate.to(compute_dtype)))
    return y
