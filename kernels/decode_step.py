"""A decode step's two expert GEMMs in one launch, in Triton.

For a handful of (token, expert) pairs the layer is weight streaming, and two GEMM launches
(w13, then w2 once the whole activation exists) each pay a launch's ramp and tail. Here a
program takes one pair and one chunk of ``BLOCK_I`` intermediate columns, and does both:

1. ``g_u = x W13[e, chunk]ᵀ (+ b13) + B13[s,e] (x A13[s,e]ᵀ)`` over all of H (gate and up
   rows of the chunk, interleaved as in ``kernels.fused_moe``), then the activation: the
   chunk's ``a`` (BLOCK_I,), rounded to the operand dtype as the two-launch path stores it.
2. The chunk's share of w2: ``y_c = w_j · (a W2[e][:, chunk]ᵀ + B2[s,e] (a A2[s,e][:, chunk]ᵀ)
   (+ b2 on chunk 0))`` for every output column, stored as one float32 row of a
   (T·k·C, H) buffer of parts (C chunks).

w2's reduction over I is thus split by chunk, with no wait between the GEMMs: no program
needs another's activation. The LoRA is linear, so each chunk's shrink goes through B on its
own. ``_sum_parts_kernel`` then adds each token's k·C parts (+ the shared expert) in a fixed
order and rounds once: deterministic, like the two-launch path's ``sum_over_k``.

Numerics differ from the two-launch path only in where w2's float32 sums are split and in the
w2 LoRA's shrink being rounded per chunk (the float32 reference is the judge:
``kernels.reference.moe_forward_reference``). FP8 experts run W8A16 (``kernels.fused_moe``'s
two modes); a chunk lies in one 128-column scale block (BLOCK_I divides 128).

Launch configuration (``MoEConfig.one_launch``, fields of the configuration's GemmConfigs):
w13.block_n = BLOCK_I, w13.block_k = the K step over H, w2.block_n = BLOCK_H (output columns
per step of part 2), w13's num_warps and num_stages.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.align import pair_slots
from kernels.configs import MoEConfig, padded_rank
from kernels.fused_moe import (
    FP8_DEQUANT,
    _dot_precision,
    _fp8_mode,
    _lora_expand,
    _main_loop,
    _pdl_launch,
    _wait_for_inputs,
)
from kernels.types import FP8_BLOCK, Activation

_ROWS = tl.constexpr(16)  # tl.dot's smallest M: the pair's row and 15 rows of zeros
_FP8_BLOCK = tl.constexpr(FP8_BLOCK)
_SUM_BLOCK_H = 256  # output columns per program of the sum
_SUM_PARTS = 16  # parts added per step of the sum


@triton.jit
def _decode_kernel(
    x_ptr,  # (T, H) hidden states
    w13_ptr,  # (E, 2I, H), FP8: float8_e4m3fn
    w2_ptr,  # (E, H, I), FP8: float8_e4m3fn
    s13_ptr,  # FP8: (E, ceil(2I/128), ceil(H/128)) float32 block scales of w13; else unused
    s2_ptr,  # FP8: (E, ceil(H/128), ceil(I/128)) float32 block scales of w2; else unused
    b13_ptr,  # (E, 2I) or unused
    b2_ptr,  # (E, H) or unused
    a13_ptr,  # (S, E, R, H) LoRA A13, or unused
    lb13_ptr,  # (S, E, 2I, R) LoRA B13
    a2_ptr,  # (S, E, R, I) LoRA A2
    lb2_ptr,  # (S, E, H, R) LoRA B2
    topk_ids_ptr,  # (T*k,) int32: each pair's expert
    topk_weights_ptr,  # (T*k,) float32
    token_slots_ptr,  # (T,) int32 adapter slot per token, or unused
    enabled_ptr,  # (S,) int32 the slots' enabled flags, or unused
    part_ptr,  # (T*k*C, H) float32: row pair*C + chunk
    H,
    inter,
    top_k,
    R,
    alpha,
    limit,
    stride_xt,
    stride_w13e,
    stride_w13n,
    stride_w2e,
    stride_w2n,
    stride_s13e,
    stride_s13n,
    stride_s13k,
    stride_s2e,
    stride_s2n,
    stride_s2k,
    stride_b13,
    stride_b2,
    stride_a13s,
    stride_a13e,
    stride_a13r,
    stride_lb13s,
    stride_lb13e,
    stride_lb13n,
    stride_lb13r,
    stride_a2s,
    stride_a2e,
    stride_a2r,
    stride_lb2s,
    stride_lb2e,
    stride_lb2n,
    stride_lb2r,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gpt_oss
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    FP8: tl.constexpr,  # 0, or kernels.fused_moe's W8A16 mode (scale each product / dequant)
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (pair, chunk), chunk fastest: both GEMMs of the pair over the chunk's
    intermediate columns, its share of the pair's output into its row of the parts."""
    _wait_for_inputs(PDL)
    chunks = tl.cdiv(inter, BLOCK_I)
    pair = tl.program_id(0) // chunks
    chunk = tl.program_id(0) % chunks
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    part_row = part_ptr + (pair * chunks + chunk).to(tl.int64) * H
    if expert < 0:  # a pair routed nowhere (expert parallelism): it adds nothing
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            tl.store(part_row + cols, tl.zeros((BLOCK_H,), dtype=tl.float32), mask=cols < H)
        return

    rows = tl.arange(0, _ROWS)
    first = rows == 0
    token = (pair // top_k).to(tl.int64)
    x_row_ptrs = x_ptr + token * stride_xt + rows * 0
    ranks = tl.arange(0, RP)
    if HAS_LORA:
        pair_slot = tl.max(pair_slots(token_slots_ptr, enabled_ptr, pair + rows * 0, first, top_k))
    else:
        pair_slot = -1
    has_adapter = pair_slot >= 0
    slot = tl.where(first & has_adapter, pair_slot, -1)
    seg = tl.where(slot >= 0, 0, -1)  # one segment: the pair's adapter
    n_seg = has_adapter.to(tl.int32)
    lora_slot = tl.maximum(pair_slot, 0).to(tl.int64)
    rank_ok = has_adapter & (ranks < R)

    # 1. w13 over all of H for the chunk's gate and up rows (interleaved: column c is gate
    # (c even) or up (c odd) of intermediate index i0 + c // 2).
    i0 = chunk * BLOCK_I
    cols13 = tl.arange(0, 2 * BLOCK_I)
    inter_idx = i0 + cols13 // 2
    w13_rows = inter_idx + (cols13 % 2) * inter
    col_mask = inter_idx < inter
    w13_cols = w13_ptr + expert * stride_w13e + w13_rows.to(tl.int64) * stride_w13n
    s13_cols = s13_ptr + expert * stride_s13e + (w13_rows // _FP8_BLOCK) * stride_s13n
    a13_cols = a13_ptr + expert * stride_a13e + lora_slot * stride_a13s + ranks * stride_a13r
    acc, xa = _main_loop(
        tl.zeros((_ROWS, 2 * BLOCK_I), dtype=tl.float32), x_row_ptrs, first, x_row_ptrs,
        w13_cols, col_mask, w13_ptr, expert, 0, 0, a13_cols, rank_ok, s13_cols, stride_s13k, H,
        _ROWS, 2 * BLOCK_I, BLOCK_K, RP, HAS_LORA, EVEN_K, 0, FP8, PRECISION,
    )  # fmt: skip
    if HAS_LORA:
        acc = _lora_expand(
            acc, xa, slot, seg, n_seg, lb13_ptr, expert, w13_rows * stride_lb13n, col_mask, R,
            stride_lb13s, stride_lb13e, stride_lb13r, RP, PRECISION,
        )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b13_ptr + expert * stride_b13 + w13_rows, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    gate, up = tl.split(tl.reshape(acc, (_ROWS, BLOCK_I, 2)))
    if ACTIVATION == 0:
        act = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    # Rounded as the two-launch path stores it; padding columns (past I) are zero.
    ks = i0 + tl.arange(0, BLOCK_I)
    k_mask = ks < inter
    a = tl.where(first[:, None] & k_mask[None, :], act, 0.0).to(x_ptr.dtype.element_ty)

    # 2. The chunk's share of w2 for every output column.
    if HAS_LORA:
        a2 = tl.load(
            a2_ptr + expert * stride_a2e + lora_slot * stride_a2s
            + ranks[None, :] * stride_a2r + ks[:, None],
            mask=rank_ok[None, :] & k_mask[:, None],
            other=0.0,
        )  # fmt: skip
        xa2 = tl.dot(a, a2, input_precision=PRECISION)
    routed_weight = tl.load(topk_weights_ptr + pair)
    w2_rows = w2_ptr + expert * stride_w2e + ks[:, None]
    s2_row = s2_ptr + expert * stride_s2e + (i0 // _FP8_BLOCK) * stride_s2k
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        h_mask = cols < H
        w = tl.load(
            w2_rows + cols.to(tl.int64)[None, :] * stride_w2n,
            mask=k_mask[:, None] & h_mask[None, :],
            other=0.0,
        )
        if FP8:
            scale = tl.load(s2_row + (cols // _FP8_BLOCK) * stride_s2n, mask=h_mask, other=0.0)
            if FP8 == FP8_DEQUANT:
                w = (w.to(tl.float32) * scale[None, :]).to(a.dtype)
                y = tl.dot(a, w, input_precision=PRECISION)
            else:
                y = tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * scale[None, :]
        else:
            y = tl.dot(a, w, input_precision=PRECISION)
        if HAS_LORA:
            y = _lora_expand(
                y, xa2, slot, seg, n_seg, lb2_ptr, expert, cols * stride_lb2n, h_mask, R,
                stride_lb2s, stride_lb2e, stride_lb2r, RP, PRECISION,
            )  # fmt: skip
        if HAS_BIAS:
            if chunk == 0:
                bias = tl.load(b2_ptr + expert * stride_b2 + cols, mask=h_mask, other=0.0)
                y += bias.to(tl.float32)[None, :]
        row = tl.sum(tl.where(first[:, None], y, 0.0), axis=0) * routed_weight
        tl.store(part_row + cols, row, mask=h_mask)


@triton.jit
def _sum_parts_kernel(
    part_ptr,  # (T * PARTS, H) float32
    addend_ptr,  # (T, H) added before rounding (shared expert), or unused
    out_ptr,  # (T, H)
    H,
    parts,
    HAS_ADDEND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = Σ_p part[t, p] (+ addend[t]) in float32, in a fixed order, rounded once."""
    _wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_P, BLOCK_H), dtype=tl.float32)
    offs_p = tl.arange(0, BLOCK_P)
    for p0 in range(0, parts, BLOCK_P):
        p = p0 + offs_p
        ptrs = part_ptr + (t * parts + p)[:, None] * H + cols[None, :]
        acc += tl.load(ptrs, mask=(p < parts)[:, None] & mask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    if HAS_ADDEND:
        total += tl.load(addend_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def decode_step(
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
    lora: tuple[torch.Tensor, ...] | None,
    token_slots: torch.Tensor | None,
    enabled: torch.Tensor | None,
    config: MoEConfig,
    addend: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_j w_j · expert_j(x) (+ LoRA) (+ addend) for every token: (T, H) in hidden's dtype,
    in two launches (``_decode_kernel``, ``_sum_parts_kernel``).

    Operands as ``kernels.fused_moe.fused_experts`` takes them; topk_ids (T, k) int32,
    topk_weights (T, k) float32; lora: (A13, B13, A2, B2) slot buffers with ``token_slots``
    (T,) and ``enabled`` (S,), or None. FP8 weights take W8A16 (``config.w13.fp8_dequant``
    chooses the mode); LoRA ranks up to ``kernels.configs.MAX_REGISTER_RANK``.
    """
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    cfg13, cfg2 = config.w13, config.w2
    block_i = cfg13.block_n
    chunks = triton.cdiv(inter, block_i)
    parts = torch.empty((t * top_k * chunks, h), dtype=torch.float32, device=hidden.device)
    if w13_scale is not None:
        assert FP8_BLOCK % block_i == 0 and FP8_BLOCK % cfg13.block_k == 0, (
            "FP8 weights need BLOCK_I and BLOCK_K dividing 128"
        )
    s13 = w13_scale if w13_scale is not None else torch.empty((1, 1, 1), device=hidden.device)
    s2 = w2_scale if w2_scale is not None else s13
    if lora is not None:
        a13, lb13, a2, lb2 = lora
        rank = a13.shape[2]
        assert token_slots is not None and enabled is not None
    else:
        a13 = lb13 = a2 = lb2 = torch.empty((1, 1, 1, 1), dtype=hidden.dtype, device=hidden.device)
        rank, token_slots, enabled = 1, topk_ids, topk_ids
    x = hidden.contiguous()
    _decode_kernel[(t * top_k * chunks,)](
        x, w13, w2, s13, s2, b13 if b13 is not None else w13, b2 if b2 is not None else w2,
        a13, lb13, a2, lb2, topk_ids, topk_weights, token_slots, enabled, parts,
        h, inter, top_k, rank, alpha, limit,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
        s13.stride(0), s13.stride(1), s13.stride(2), s2.stride(0), s2.stride(1), s2.stride(2),
        b13.stride(0) if b13 is not None else 0, b2.stride(0) if b2 is not None else 0,
        a13.stride(0), a13.stride(1), a13.stride(2),
        lb13.stride(0), lb13.stride(1), lb13.stride(2), lb13.stride(3),
        a2.stride(0), a2.stride(1), a2.stride(2),
        lb2.stride(0), lb2.stride(1), lb2.stride(2), lb2.stride(3),
        ACTIVATION=0 if activation is Activation.SILU else 1,
        HAS_BIAS=b13 is not None, HAS_LORA=lora is not None,
        FP8=_fp8_mode(w13_scale, cfg13),
        BLOCK_I=block_i, BLOCK_K=cfg13.block_k, BLOCK_H=cfg2.block_n,
        RP=padded_rank(rank), EVEN_K=h % cfg13.block_k == 0,
        PRECISION=_dot_precision(hidden.dtype), **_pdl_launch(hidden.device),
        num_warps=cfg13.num_warps, num_stages=cfg13.num_stages,
    )  # fmt: skip
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
    _sum_parts_kernel[(t, triton.cdiv(h, _SUM_BLOCK_H))](
        parts, addend if addend is not None else parts, out, h, top_k * chunks,
        HAS_ADDEND=addend is not None, BLOCK_H=_SUM_BLOCK_H, BLOCK_P=_SUM_PARTS,
        **_pdl_launch(hidden.device),
    )  # fmt: skip
    return out
