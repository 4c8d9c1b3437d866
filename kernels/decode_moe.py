"""The MoE layer for a handful of tokens (decode): two launches, no alignment.

When a batch has only a few (token, expert) pairs, the aligned path of ``kernels.fused_moe``
pays fixed costs that dwarf its memory floor: an alignment launch, a 16-row MMA block per pair,
an fp32 sum over k by atomics and a last launch for the cast. Here every program streams
weights and does matrix-vector work on the CUDA cores, so the time is the weight bytes over
the bandwidth:

``_decode_w13_kernel``, grid (pairs, cdiv(I, BLOCK_N)): pair p = t*k + j reads token t's row,
    its expert's gate and up rows ``[n0, n0 + BLOCK_N)`` and, with an adapter, the LoRA A rows
    in the same K loop (the shrink costs no extra pass); then the expand, bias and activation.
    Stores the activation (pairs, I) in the hidden states' dtype.
``_decode_w2_kernel``, grid (T, cdiv(H, BLOCK_N)): token t's output columns, summed over its k
    experts in one flattened loop (k × K steps, so the pipeline never drains between experts),
    times the routed weights, plus the shared expert's output, rounded once to the output
    dtype. The sum over k has a fixed order: the result is deterministic, and no fp32 buffer,
    atomics or cast launch are needed.

Numerics follow the aligned path: operand products in fp32, fp32 sums, the rank-R vectors and
the activation rounded to the operand dtype before they are multiplied again. Ranks above
``kernels.configs.MAX_REGISTER_RANK`` take the aligned path (the A and B tiles of one K step
would not fit in registers).

Shapes: hidden (T, H); w13 (E, 2I, H) rows [gate; up]; w2 (E, H, I); b13 (E, 2I), b2 (E, H);
topk_ids (T, k) int32, topk_weights (T, k) fp32; LoRA A13 (S, E, R, H), B13 (S, E, 2I, R),
A2 (S, E, R, I), B2 (S, E, H, R); token_slots (T,) int32, enabled (S,) int32.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.configs import MAX_REGISTER_RANK, GemmConfig, padded_rank
from kernels.types import Activation


@triton.jit
def _token_slot(token_slots_ptr, enabled_ptr, token, HAS_LORA: tl.constexpr):
    """Token's effective slot (int64), -1 without an adapter or for a disabled slot."""
    if HAS_LORA:
        slot = tl.load(token_slots_ptr + token)
        on = tl.load(enabled_ptr + tl.maximum(slot, 0))
        return tl.where((slot >= 0) & (on != 0), slot, -1).to(tl.int64)
    return tl.full((), -1, tl.int64)


@triton.jit
def _expand(acc, xa, b_rows, rank_mask, col_mask, stride_br, dtype):
    """acc (BLOCK_N,) + B[cols, :R] · xa, with xa (RP,) rounded to the operand dtype first."""
    ranks = tl.arange(0, xa.shape[0])
    b = tl.load(
        b_rows[:, None] + ranks[None, :] * stride_br,
        mask=col_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    return acc + tl.sum(b.to(tl.float32) * xa.to(dtype).to(tl.float32)[None, :], axis=1)


@triton.jit
def _decode_w13_kernel(
    x_ptr,  # (T, H)
    w_ptr,  # (E, 2I, H)
    bias_ptr,  # (E, 2I) or unused
    a_ptr,  # (S, E, R, H) LoRA A13 or unused
    b_ptr,  # (S, E, 2I, R) LoRA B13 or unused
    out_ptr,  # (T*k, I) activation, one row per pair
    topk_ids_ptr,  # (T*k,)
    token_slots_ptr,  # (T,)
    enabled_ptr,  # (S,)
    H,
    inter,
    top_k,
    R,
    alpha,
    limit,
    stride_xt,
    stride_we,
    stride_wn,
    stride_bias,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gpt_oss
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RP: tl.constexpr,
):
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    gate_rows = w_ptr + expert * stride_we + cols.to(tl.int64) * stride_wn
    up_rows = gate_rows + inter * stride_wn
    x_row = x_ptr + token.to(tl.int64) * stride_xt
    offs_k = tl.arange(0, BLOCK_K)

    slot = _token_slot(token_slots_ptr, enabled_ptr, token, HAS_LORA)
    ranks = tl.arange(0, RP)
    rank_mask = (ranks < R) & (slot >= 0)  # all off without an adapter: A is never read
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + expert * stride_ae + ranks * stride_ar

    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    xa = tl.zeros((RP,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < H
        x = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w_g = tl.load(gate_rows[:, None] + k[None, :], mask=w_mask, other=0.0)
        w_u = tl.load(up_rows[:, None] + k[None, :], mask=w_mask, other=0.0)
        gate += tl.sum(w_g.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(w_u.to(tl.float32) * x[None, :], axis=1)
        if HAS_LORA:
            a = tl.load(
                a_rows[:, None] + k[None, :], mask=rank_mask[:, None] & k_mask[None, :], other=0.0
            )
            xa += tl.sum(a.to(tl.float32) * x[None, :], axis=1)

    dtype = out_ptr.dtype.element_ty
    if HAS_LORA:
        b_gate = b_ptr + tl.maximum(slot, 0) * stride_bs + expert * stride_be + cols * stride_bn
        gate = _expand(gate, xa, b_gate, rank_mask, col_mask, stride_br, dtype)
        up = _expand(up, xa, b_gate + inter * stride_bn, rank_mask, col_mask, stride_br, dtype)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_bias + cols
        gate += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)
        up += tl.load(bias + inter, mask=col_mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, act.to(dtype), mask=col_mask)


@triton.jit
def _decode_w2_kernel(
    act_ptr,  # (T*k, I) from _decode_w13_kernel
    w_ptr,  # (E, H, I)
    bias_ptr,  # (E, H) or unused
    a_ptr,  # (S, E, R, I) LoRA A2 or unused
    b_ptr,  # (S, E, H, R) LoRA B2 or unused
    addend_ptr,  # (T, H) added before the rounding (shared expert), or unused
    out_ptr,  # (T, H)
    topk_ids_ptr,  # (T*k,)
    topk_weights_ptr,  # (T*k,) fp32
    token_slots_ptr,
    enabled_ptr,
    H,
    inter,
    R,
    stride_am,
    stride_we,
    stride_wn,
    stride_bias,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RP: tl.constexpr,
    K_P2: tl.constexpr,  # TOP_K rounded up to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < H
    offs_k = tl.arange(0, BLOCK_K)
    slot = _token_slot(token_slots_ptr, enabled_ptr, token, HAS_LORA)
    ranks = tl.arange(0, RP)
    rank_mask = (ranks < R) & (slot >= 0)
    slot_a = a_ptr + tl.maximum(slot, 0) * stride_as + ranks * stride_ar
    experts_j = tl.arange(0, K_P2)

    # One loop over (expert j, K step): the weights stream without a pipeline restart per j.
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    xa = tl.zeros((K_P2, RP), dtype=tl.float32)  # row j: a_j · A2[s, e_j]ᵀ
    steps = tl.cdiv(inter, BLOCK_K)
    for i in range(0, TOP_K * steps):
        j = i // steps
        k = (i - j * steps) * BLOCK_K + offs_k
        k_mask = k < inter
        pair = token * TOP_K + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        routed = tl.load(topk_weights_ptr + pair)
        a = tl.load(act_ptr + pair * stride_am + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + k[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        out += routed * tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if HAS_LORA:
            lora_a = tl.load(
                slot_a[:, None] + expert * stride_ae + k[None, :],
                mask=rank_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            part = tl.sum(lora_a.to(tl.float32) * a[None, :], axis=1)
            xa += tl.where((experts_j == j)[:, None], part[None, :], 0.0)

    dtype = out_ptr.dtype.element_ty
    if HAS_LORA or HAS_BIAS:
        for j in range(0, TOP_K):
            pair = token * TOP_K + j
            expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
            routed = tl.load(topk_weights_ptr + pair)
            extra = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if HAS_LORA:
                xa_j = tl.sum(tl.where((experts_j == j)[:, None], xa, 0.0), axis=0)
                b_rows = b_ptr + tl.maximum(slot, 0) * stride_bs + expert * stride_be
                extra = _expand(
                    extra, xa_j, b_rows + cols * stride_bn, rank_mask, col_mask, stride_br, dtype
                )
            if HAS_BIAS:
                bias = bias_ptr + expert * stride_bias + cols
                extra += tl.load(bias, mask=col_mask, other=0.0).to(tl.float32)
            out += routed * extra
    if HAS_ADDEND:
        out += tl.load(addend_ptr + token * H + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, out.to(dtype), mask=col_mask)


@dataclass(frozen=True)
class DecodeLoRA:
    """The LoRA operands of a decode forward."""

    a13: torch.Tensor  # (S, E, R, H)
    b13: torch.Tensor  # (S, E, 2I, R)
    a2: torch.Tensor  # (S, E, R, I)
    b2: torch.Tensor  # (S, E, H, R)
    token_slots: torch.Tensor  # (T,) int32
    enabled: torch.Tensor  # (S,) int32


def decode_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    lora: DecodeLoRA | None,
    w13_config: GemmConfig,
    w2_config: GemmConfig,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_j w_j · expert_j(x) (+ LoRA) (+ addend) for every token: (T, H) in hidden's dtype.

    Same contract as ``kernels.fused_moe.fused_experts``; the configurations' block_n,
    block_k, num_warps and num_stages apply. Every operand has a contiguous last dimension.
    """
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    out = torch.empty_like(hidden)
    if t == 0:
        return out
    act = torch.empty((t * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    if lora is None:
        dummy = torch.empty((1, 1, 1, 1), dtype=hidden.dtype, device=hidden.device)
        a13 = b13_l = a2 = b2_l = dummy
        slots_arg = enabled_arg = topk_ids
        rank, rp = 1, 16
    else:
        if padded_rank(lora.a13.shape[2]) > MAX_REGISTER_RANK:
            raise ValueError(f"the decode kernels take ranks up to {MAX_REGISTER_RANK}")
        a13, b13_l, a2, b2_l = lora.a13, lora.b13, lora.a2, lora.b2
        slots_arg, enabled_arg = lora.token_slots, lora.enabled
        rank, rp = a13.shape[2], padded_rank(a13.shape[2])
    bias13 = b13 if b13 is not None else w13
    cfg = w13_config
    _decode_w13_kernel[(t * top_k, triton.cdiv(inter, cfg.block_n))](
        hidden, w13, bias13, a13, b13_l, act, topk_ids, slots_arg, enabled_arg,
        h, inter, top_k, rank, alpha, limit,
        hidden.stride(0), w13.stride(0), w13.stride(1), bias13.stride(0),
        a13.stride(0), a13.stride(1), a13.stride(2),
        b13_l.stride(0), b13_l.stride(1), b13_l.stride(2), b13_l.stride(3),
        act.stride(0),
        ACTIVATION=0 if activation is Activation.SILU else 1,
        HAS_BIAS=b13 is not None, HAS_LORA=lora is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, RP=rp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    bias2 = b2 if b2 is not None else w2
    cfg = w2_config
    _decode_w2_kernel[(t, triton.cdiv(h, cfg.block_n))](
        act, w2, bias2, a2, b2_l, addend if addend is not None else out, out,
        topk_ids, topk_weights, slots_arg, enabled_arg,
        h, inter, rank,
        act.stride(0), w2.stride(0), w2.stride(1), bias2.stride(0),
        a2.stride(0), a2.stride(1), a2.stride(2),
        b2_l.stride(0), b2_l.stride(1), b2_l.stride(2), b2_l.stride(3),
        out.stride(0),
        TOP_K=top_k, HAS_BIAS=b2 is not None, HAS_LORA=lora is not None,
        HAS_ADDEND=addend is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, RP=rp,
        K_P2=triton.next_power_of_2(top_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
