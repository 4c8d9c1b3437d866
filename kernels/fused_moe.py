"""Grouped GEMMs of the MoE layer with the multi-LoRA delta fused in, in Triton.

Two kernels run over the blocks of ``kernels.align`` (BLOCK_M pairs of one expert each):

``_w13_kernel``: for the block's pairs, ``g_u = x W13[e]ᵀ (+ b13) + B13[s,e](A13[s,e] x)``,
    then the activation, stored as the (rows, I) intermediate in the aligned row order.
    Gate and up columns are interleaved in one tile (gate column i next to up column i), so
    one dot yields both and the activation runs in the epilogue: the (rows, 2I) pre-activation
    never goes to memory.
``_w2_kernel``: ``y = a W2[e]ᵀ (+ b2) + B2[s,e](A2[s,e] a)``, times the pair's routed weight,
    either atomically added (fp32) into the (T, H) output, so the sum over k needs no
    (T*k, H) buffer, or stored per pair for ``_sum_k_kernel`` (deterministic); the launch
    configuration chooses (``MoEConfig.atomic_sum``).

LoRA, fused in both: a block holds up to a few adapter slots ("segments", rows sorted by slot).
The shrink ``x A[s]ᵀ`` of up to ``LORA_SEGMENTS`` segments is *one* dot against the segments'
A matrices stacked side by side, done inside the main K loop on the x tiles already loaded,
so it costs no extra pass over x; each row keeps the rank-R slice of its own segment
(``_collapse``), in registers. The expand is the mirror image: each row's slice placed in its
segment's columns (``_spread``), one dot against the stacked B tiles, added to the accumulator
before the epilogue. The rank-R intermediate never touches memory. A program computes
``TILES_PER_PROGRAM`` consecutive N tiles and does the shrink once, in the first. Blocks with
more segments than ``LORA_SEGMENTS`` (small batches, many adapters) take extra shrink passes.

Dtypes: bf16/fp16 operands with fp32 accumulation (the shrink result is rounded to the operand
dtype for the expand, as the intermediate ``a`` is); fp32 operands use exact IEEE dots.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.align import Alignment
from kernels.configs import MoEConfig
from kernels.types import Activation

_CLEAR_BLOCK = 1024  # elements each w13 program zeroes per step of the output clear


@triton.jit
def _row_segments(row_slots_ptr, row0, BLOCK_M: tl.constexpr):
    """Slots of the block's rows, each row's segment index (-1: no LoRA), the segment count."""
    offs = tl.arange(0, BLOCK_M)
    slot = tl.load(row_slots_ptr + row0 + offs)
    prev = tl.load(row_slots_ptr + row0 + offs - 1, mask=offs > 0, other=-1)
    first = ((slot >= 0) & (slot != prev)).to(tl.int32)
    seg = tl.where(slot >= 0, tl.cumsum(first, 0) - 1, -1)
    return slot, seg, tl.sum(first, axis=0)


@triton.jit
def _segment_columns(slot, seg, chunk, R, NSEG: tl.constexpr, RP: tl.constexpr):
    """For the stacked LoRA dot of segments chunk*NSEG.. : the slot and rank index of each of
    its NSEG*RP columns, and which columns are real (a segment that exists, r < R)."""
    target = chunk * NSEG + tl.arange(0, NSEG)
    seg_slot = tl.max(tl.where(seg[:, None] == target[None, :], slot[:, None], -1), axis=0)
    col_slot = tl.reshape(tl.broadcast_to(seg_slot[:, None], (NSEG, RP)), (NSEG * RP,))
    col_rank = tl.arange(0, NSEG * RP) % RP
    return col_slot, col_rank, (col_slot >= 0) & (col_rank < R)


@triton.jit
def _collapse(xa_stacked, seg, chunk, BLOCK_M: tl.constexpr, NSEG: tl.constexpr, RP: tl.constexpr):
    """(BLOCK_M, NSEG*RP) → (BLOCK_M, RP): each row keeps the slice of its own segment."""
    x3 = tl.reshape(xa_stacked, (BLOCK_M, NSEG, RP))
    target = chunk * NSEG + tl.arange(0, NSEG)
    mine = seg[:, None, None] == target[None, :, None]
    return tl.sum(tl.where(mine, x3, 0.0), axis=1)


@triton.jit
def _spread(xa, seg, chunk, BLOCK_M: tl.constexpr, NSEG: tl.constexpr, RP: tl.constexpr):
    """(BLOCK_M, RP) → (BLOCK_M, NSEG*RP): each row's slice in its segment's columns, else 0."""
    target = chunk * NSEG + tl.arange(0, NSEG)
    mine = seg[:, None, None] == target[None, :, None]
    return tl.reshape(tl.where(mine, xa[:, None, :], 0.0), (BLOCK_M, NSEG * RP))


@triton.jit
def _lora_shrink(
    x_row_ptrs,
    x_row_mask,
    a_ptr,
    expert,
    slot,
    seg,
    chunk,
    K,
    R,
    stride_las,
    stride_lae,
    stride_lar,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """x·A[s]ᵀ of one chunk of segments in its own K loop: (BLOCK_M, RP) fp32 per row."""
    col_slot, col_rank, col_mask = _segment_columns(slot, seg, chunk, R, NSEG, RP)
    offs_k = tl.arange(0, BLOCK_K)
    a_cols = (
        a_ptr + expert * stride_lae + col_slot.to(tl.int64) * stride_las + col_rank * stride_lar
    )
    xa = tl.zeros((BLOCK_M, NSEG * RP), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(
            x_row_ptrs[:, None] + (k0 + offs_k)[None, :],
            mask=x_row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_cols[None, :] + (k0 + offs_k)[:, None],
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        xa = tl.dot(x, a, xa, input_precision=PRECISION)
    return _collapse(xa, seg, chunk, BLOCK_M, NSEG, RP)


@triton.jit
def _main_loop(
    x_row_ptrs,
    x_row_mask,
    w_cols,
    w_col_mask,
    a_ptr,
    expert,
    slot,
    seg,
    K,
    R,
    stride_las,
    stride_lae,
    stride_lar,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    WITH_SHRINK: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc = x·Wᵀ over K for one tile; with WITH_SHRINK also the first chunk's LoRA shrink
    on the same x tiles. x_row_ptrs (BLOCK_M,) and w_cols (BLOCK_N,) point at k = 0 of each
    row of x and of W; K is contiguous in both."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_row_ptrs[:, None] + offs_k[None, :]
    w_ptrs = w_cols[None, :] + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, NSEG * RP), dtype=tl.float32)
    if WITH_SHRINK:
        col_slot, col_rank, col_mask = _segment_columns(slot, seg, 0, R, NSEG, RP)
        a_cols = (
            a_ptr + expert * stride_lae + col_slot.to(tl.int64) * stride_las + col_rank * stride_lar
        )
        a_ptrs = a_cols[None, :] + offs_k[:, None]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=x_row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=w_col_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=x_row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=w_col_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if WITH_SHRINK:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=col_mask[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=col_mask[None, :] & k_mask[:, None], other=0.0)
            xa = tl.dot(x, a, xa, input_precision=PRECISION)
            a_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if WITH_SHRINK:
        xa = _collapse(xa, seg, 0, BLOCK_M, NSEG, RP)
    else:
        xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
    return acc, xa


@triton.jit
def _tile(
    x_row_ptrs,
    x_row_mask,
    w_cols,
    w_col_mask,
    a_ptr,
    b_ptr,
    b_rows,
    expert,
    slot,
    seg,
    n_seg,
    xa,
    first_tile,
    K,
    R,
    stride_las,
    stride_lae,
    stride_lar,
    stride_lbs,
    stride_lbe,
    stride_lbr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    HAS_LORA: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) output tile, base GEMM plus LoRA delta, in fp32.

    ``xa`` (BLOCK_M, RP) carries the rows' shrink results between the tiles of a program;
    chunks after the first are already in it, the first chunk is added in the first tile.
    ``b_rows`` (BLOCK_N,): row offset of each output column inside a B[s, e] matrix.
    """
    if HAS_LORA:
        if first_tile & (n_seg > 0):
            acc, xa0 = _main_loop(
                x_row_ptrs, x_row_mask, w_cols, w_col_mask, a_ptr, expert, slot, seg, K, R,
                stride_las, stride_lae, stride_lar,
                BLOCK_M, BLOCK_N, BLOCK_K, NSEG, RP, True, EVEN_K, PRECISION,
            )  # fmt: skip
            xa += xa0
        else:
            acc, _ = _main_loop(
                x_row_ptrs, x_row_mask, w_cols, w_col_mask, a_ptr, expert, slot, seg, K, R,
                stride_las, stride_lae, stride_lar,
                BLOCK_M, BLOCK_N, BLOCK_K, NSEG, RP, False, EVEN_K, PRECISION,
            )  # fmt: skip
        # Expand: per chunk of segments, one dot of the spread shrink results with the
        # segments' B tiles stacked along the rank.
        for chunk in range(0, tl.cdiv(n_seg, NSEG)):
            col_slot, col_rank, col_mask = _segment_columns(slot, seg, chunk, R, NSEG, RP)
            b_ptrs = (
                b_ptr
                + expert * stride_lbe
                + (col_slot.to(tl.int64) * stride_lbs + col_rank * stride_lbr)[:, None]
                + b_rows[None, :]
            )
            b = tl.load(b_ptrs, mask=col_mask[:, None] & w_col_mask[None, :], other=0.0)
            spread = _spread(xa, seg, chunk, BLOCK_M, NSEG, RP).to(b.dtype)
            acc = tl.dot(spread, b, acc, input_precision=PRECISION)
    else:
        acc, _ = _main_loop(
            x_row_ptrs, x_row_mask, w_cols, w_col_mask, a_ptr, expert, slot, seg, K, R,
            stride_las, stride_lae, stride_lar,
            BLOCK_M, BLOCK_N, BLOCK_K, NSEG, RP, False, EVEN_K, PRECISION,
        )  # fmt: skip
    return acc, xa


@triton.jit
def _extra_shrink_chunks(
    x_row_ptrs,
    x_row_mask,
    a_ptr,
    expert,
    slot,
    seg,
    n_seg,
    K,
    R,
    stride_las,
    stride_lae,
    stride_lar,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Shrink results of the segments past the first NSEG (each chunk its own K loop)."""
    xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
    for chunk in range(1, tl.cdiv(n_seg, NSEG)):
        xa += _lora_shrink(
            x_row_ptrs, x_row_mask, a_ptr, expert, slot, seg, chunk, K, R,
            stride_las, stride_lae, stride_lar, BLOCK_M, BLOCK_K, NSEG, RP, PRECISION,
        )  # fmt: skip
    return xa


@triton.jit
def _w13_kernel(
    x_ptr,  # (T, H) hidden states
    w_ptr,  # (E, 2I, H)
    bias_ptr,  # (E, 2I) or unused
    a_ptr,  # (S, E, R, H) LoRA A13
    b_ptr,  # (S, E, 2I, R) LoRA B13
    out_ptr,  # (max_rows, I) activation, aligned row order
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    clear_ptr,  # (T*H,) fp32 output of the w2 kernel, zeroed here
    clear_numel,
    clear_per_program,
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
    stride_las,
    stride_lae,
    stride_lar,
    stride_lbs,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    stride_om,
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gpt_oss
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    # The w2 kernel adds into a zeroed fp32 buffer; clearing it here saves a memset launch.
    clear_start = (pid_n * tl.num_programs(0) + pid_m) * clear_per_program
    clear_end = tl.minimum(clear_start + clear_per_program, clear_numel)
    for c0 in range(clear_start, clear_end, CLEAR_BLOCK):
        offs = c0 + tl.arange(0, CLEAR_BLOCK)
        tl.store(clear_ptr + offs, 0.0, mask=offs < clear_end)

    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + rows)
    x_row_mask = pair >= 0
    x_row_ptrs = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    if HAS_LORA:
        slot, seg, n_seg = _row_segments(row_slots_ptr, row0, BLOCK_M)
        xa = _extra_shrink_chunks(
            x_row_ptrs, x_row_mask, a_ptr, expert, slot, seg, n_seg, H, R,
            stride_las, stride_lae, stride_lar, BLOCK_M, BLOCK_K, NSEG, RP, PRECISION,
        )  # fmt: skip
    else:
        slot = rows
        seg = rows
        n_seg = 0
        xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)

    # Tile columns interleave gate and up: column c is gate (c even) or up (c odd) of
    # intermediate index n0 + c // 2, i.e. row (n0 + c // 2) + (c % 2) * I of W13.
    cols = tl.arange(0, 2 * BLOCK_N)
    num_tiles = tl.cdiv(inter, BLOCK_N)
    first = pid_n * TILES_PER_PROGRAM
    for tile in range(first, tl.minimum(first + TILES_PER_PROGRAM, num_tiles)):
        n0 = tile * BLOCK_N
        inter_idx = n0 + cols // 2
        w13_rows = inter_idx + (cols % 2) * inter
        col_mask = inter_idx < inter
        w_cols = w_ptr + expert * stride_we + w13_rows.to(tl.int64) * stride_wn
        acc, xa = _tile(
            x_row_ptrs, x_row_mask, w_cols, col_mask, a_ptr, b_ptr, w13_rows * stride_lbn,
            expert, slot, seg, n_seg, xa, tile == first, H, R,
            stride_las, stride_lae, stride_lar, stride_lbs, stride_lbe, stride_lbr,
            BLOCK_M, 2 * BLOCK_N, BLOCK_K, NSEG, RP, HAS_LORA, EVEN_K, PRECISION,
        )  # fmt: skip
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias + w13_rows, mask=col_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        if ACTIVATION == 0:
            act = gate * tl.sigmoid(gate) * up
        else:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
        out_cols = n0 + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + out_cols[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=(out_cols < inter)[None, :])


@triton.jit
def _w2_kernel(
    act_ptr,  # (max_rows, I) activation from _w13_kernel
    w_ptr,  # (E, H, I)
    bias_ptr,  # (E, H) or unused
    a_ptr,  # (S, E, R, I) LoRA A2
    b_ptr,  # (S, E, H, R) LoRA B2
    out_ptr,  # ATOMIC_SUM: (T, H) fp32 zeroed by _w13_kernel; else (T*k, H), row per pair
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    topk_weights_ptr,  # (T*k,) fp32
    H,
    inter,
    top_k,
    R,
    stride_am,
    stride_we,
    stride_wn,
    stride_bias,
    stride_las,
    stride_lae,
    stride_lar,
    stride_lbs,
    stride_lbe,
    stride_lbn,
    stride_lbr,
    stride_out,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    ATOMIC_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + rows)
    valid = pair >= 0
    # Padding rows of the activation were written by _w13_kernel (finite): no mask needed.
    x_row_mask = rows >= 0
    x_row_ptrs = act_ptr + rows.to(tl.int64) * stride_am
    routed_weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)
    if ATOMIC_SUM:
        out_rows = out_ptr + (pair // top_k).to(tl.int64) * stride_out
    else:
        out_rows = out_ptr + pair.to(tl.int64) * stride_out
    if HAS_LORA:
        slot, seg, n_seg = _row_segments(row_slots_ptr, row0, BLOCK_M)
        xa = _extra_shrink_chunks(
            x_row_ptrs, x_row_mask, a_ptr, expert, slot, seg, n_seg, inter, R,
            stride_las, stride_lae, stride_lar, BLOCK_M, BLOCK_K, NSEG, RP, PRECISION,
        )  # fmt: skip
    else:
        slot = rows
        seg = rows
        n_seg = 0
        xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)

    num_tiles = tl.cdiv(H, BLOCK_N)
    first = pid_n * TILES_PER_PROGRAM
    for tile in range(first, tl.minimum(first + TILES_PER_PROGRAM, num_tiles)):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < H
        w_cols = w_ptr + expert * stride_we + cols.to(tl.int64) * stride_wn
        acc, xa = _tile(
            x_row_ptrs, x_row_mask, w_cols, col_mask, a_ptr, b_ptr, cols * stride_lbn,
            expert, slot, seg, n_seg, xa, tile == first, inter, R,
            stride_las, stride_lae, stride_lar, stride_lbs, stride_lbe, stride_lbr,
            BLOCK_M, BLOCK_N, BLOCK_K, NSEG, RP, HAS_LORA, EVEN_K, PRECISION,
        )  # fmt: skip
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_bias + cols, mask=col_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        acc *= routed_weight[:, None]
        out_ptrs = out_rows[:, None] + cols[None, :]
        out_mask = valid[:, None] & col_mask[None, :]
        if ATOMIC_SUM:
            tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_k_kernel(
    y_ptr,  # (T, k, H): each pair's weighted expert output
    addend_ptr,  # (T, H) added before rounding (shared expert), or unused
    out_ptr,  # (T, H)
    H,
    TOP_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = Σ_j y[t, j] (+ addend[t]) in fp32, in a fixed order: deterministic."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADDEND:
        acc += tl.load(addend_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _lora_meta(rank: int, segments: int) -> tuple[int, int]:
    """(NSEG, RP): segments per stacked dot and the rank padded to a power of two such that
    the stacked width NSEG * RP is at least 16 (tl.dot's minimum)."""
    rp = max(triton.next_power_of_2(rank), 16 // segments, 1)
    return segments, rp


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


LoRAPair = tuple[torch.Tensor, torch.Tensor]


def _lora_args(
    lora: LoRAPair | None, alignment: Alignment, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(A, B, row_slots, HAS_LORA); without LoRA, placeholders the kernel never reads."""
    if lora is not None and alignment.row_slots is not None:
        return lora[0], lora[1], alignment.row_slots, True
    unused = torch.empty((1, 1, 1, 1), dtype=like.dtype, device=like.device)
    return unused, unused, alignment.sorted_pair_ids, False


def w13_stage(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    top_k: int,
    alignment: Alignment,
    lora13: LoRAPair | None,
    config: MoEConfig,
    clear: torch.Tensor | None,
) -> torch.Tensor:
    """act = activation(x W13ᵀ (+ b13) + LoRA) for every aligned row: (max_rows, I).

    hidden (T, H); w13 (E, 2I, H); b13 (E, 2I) or None; lora13 = (A13 (S, E, R, H),
    B13 (S, E, 2I, R)) or None. ``clear``: a float32 buffer this launch zeroes on the side.
    """
    h = hidden.shape[1]
    inter = w13.shape[1] // 2
    block_m, max_blocks = alignment.block_m, alignment.max_blocks
    lora_a, lora_b, row_slots, has_lora = _lora_args(lora13, alignment, hidden)
    nseg, rp = _lora_meta(lora_a.shape[2], config.lora_segments)
    act = torch.empty((max_blocks * block_m, inter), dtype=hidden.dtype, device=hidden.device)
    bias = b13 if b13 is not None else w13
    clear_buf = clear if clear is not None else act
    cfg = config.w13
    grid = (max_blocks, triton.cdiv(triton.cdiv(inter, cfg.block_n), cfg.tiles_per_program))
    clear_numel = 0 if clear is None else clear.numel()
    clear_per_program = triton.cdiv(triton.cdiv(clear_numel, grid[0] * grid[1]), _CLEAR_BLOCK)
    _w13_kernel[grid](
        hidden, w13, bias, lora_a, lora_b, act,
        alignment.sorted_pair_ids, row_slots, alignment.block_experts,
        clear_buf, clear_numel, clear_per_program * _CLEAR_BLOCK,
        h, inter, top_k, lora_a.shape[2], alpha, limit,
        hidden.stride(0), w13.stride(0), w13.stride(1), bias.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), lora_b.stride(3),
        act.stride(0),
        ACTIVATION=0 if activation is Activation.SILU else 1,
        HAS_BIAS=b13 is not None, HAS_LORA=has_lora,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        TILES_PER_PROGRAM=cfg.tiles_per_program, NSEG=nseg, RP=rp,
        EVEN_K=h % cfg.block_k == 0, PRECISION=_dot_precision(hidden.dtype),
        CLEAR_BLOCK=_CLEAR_BLOCK, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return act


def w2_stage(
    act: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    alignment: Alignment,
    lora2: LoRAPair | None,
    config: MoEConfig,
    out: torch.Tensor,
) -> None:
    """y = w_j · (a W2ᵀ (+ b2) + LoRA) for every pair, into ``out``.

    act (max_rows, I) from ``w13_stage``; w2 (E, H, I); b2 (E, H) or None; topk_weights (T, k)
    float32; lora2 = (A2 (S, E, R, I), B2 (S, E, H, R)) or None. With ``config.atomic_sum``
    ``out`` is (T, H) float32, zeroed, and receives Σ_j y_j; else it is (T*k, H) and row p
    receives pair p's y.
    """
    h, inter = w2.shape[1], w2.shape[2]
    lora_a, lora_b, row_slots, has_lora = _lora_args(lora2, alignment, act)
    nseg, rp = _lora_meta(lora_a.shape[2], config.lora_segments)
    bias = b2 if b2 is not None else w2
    cfg = config.w2
    grid = (alignment.max_blocks, triton.cdiv(triton.cdiv(h, cfg.block_n), cfg.tiles_per_program))
    _w2_kernel[grid](
        act, w2, bias, lora_a, lora_b, out,
        alignment.sorted_pair_ids, row_slots, alignment.block_experts, topk_weights,
        h, inter, topk_weights.shape[1], lora_a.shape[2],
        act.stride(0), w2.stride(0), w2.stride(1), bias.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), lora_b.stride(3),
        out.stride(0),
        HAS_BIAS=b2 is not None, HAS_LORA=has_lora, ATOMIC_SUM=config.atomic_sum,
        BLOCK_M=alignment.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        TILES_PER_PROGRAM=cfg.tiles_per_program, NSEG=nseg, RP=rp,
        EVEN_K=inter % cfg.block_k == 0, PRECISION=_dot_precision(act.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def sum_over_k(y: torch.Tensor, top_k: int, addend: torch.Tensor | None) -> torch.Tensor:
    """(T*k, H) pair rows → (T, H) Σ_j (+ addend), summed in float32, in y's dtype."""
    rows, h = y.shape
    out = torch.empty((rows // top_k, h), dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_k_kernel[(rows // top_k, triton.cdiv(h, block_h))](
        y, addend if addend is not None else y, out, h,
        TOP_K=top_k, HAS_ADDEND=addend is not None, BLOCK_H=block_h,
    )  # fmt: skip
    return out


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    topk_weights: torch.Tensor,
    alignment: Alignment,
    lora: tuple[LoRAPair, LoRAPair] | None,
    config: MoEConfig,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_j w_j · expert_j(x) (+ LoRA) (+ addend) for every token: (T, H) in hidden's dtype.

    hidden (T, H); w13 (E, 2I, H); w2 (E, H, I); b13 (E, 2I) / b2 (E, H) or None;
    topk_weights (T, k) float32; lora = ((A13, B13), (A2, B2)) slot buffers or None;
    addend (T, H) (the shared expert's output) is added before the one final rounding.
    All operands share hidden's dtype and have a contiguous last dimension.
    """
    t, h = hidden.shape
    top_k = topk_weights.shape[1]
    lora13, lora2 = lora if lora is not None else (None, None)
    if config.atomic_sum:
        acc = torch.empty((t, h), dtype=torch.float32, device=hidden.device)
        act = w13_stage(
            hidden, w13, b13, activation, alpha, limit, top_k, alignment, lora13, config, acc
        )
        w2_stage(act, w2, b2, topk_weights, alignment, lora2, config, acc)
        if addend is not None:
            acc += addend
        return acc.to(hidden.dtype)
    act = w13_stage(
        hidden, w13, b13, activation, alpha, limit, top_k, alignment, lora13, config, None
    )
    y = torch.empty((t * top_k, h), dtype=hidden.dtype, device=hidden.device)
    w2_stage(act, w2, b2, topk_weights, alignment, lora2, config, y)
    return sum_over_k(y, top_k, addend)
