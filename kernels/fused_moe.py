"""Grouped GEMMs of the MoE layer with the multi-LoRA delta fused in, in Triton.

The kernels run over the blocks of ``kernels.align`` (BLOCK_M pairs of one expert each):

``_lora_shrink_kernel`` (LoRA, unless fused): ``xa = x A[s,e]ᵀ`` for every aligned row, once
    per block (a program per 64 rows), into a small (rows, R) buffer in the operand dtype; run
    on the hidden states with A13 before w13 and on the activation with A2 before w2. With
    ``GemmConfig.shrink_split_k`` each block's K is cut into parts, a program each, adding
    into a float32 buffer (decode: a handful of blocks would otherwise loop over all of K).
``_w13_kernel``: ``g_u = x W13[e]ᵀ (+ b13) + B13[s,e] xa13``, then the activation, stored as
    the (rows, I) intermediate ``a`` in the aligned row order. Gate and up columns share one
    tile (interleaved with pointer loads; [gate | up] halves when one TMA box of W13 seen as
    (E, 2, I, H) brings both), so one dot yields both and the activation runs in the epilogue:
    the (rows, 2I) pre-activation never goes to memory.
``_w2_kernel``: ``y = a W2[e]ᵀ (+ b2) + B2[s,e] xa2``, times the pair's routed weight, either
    atomically added (fp32) into the (T, H) output, so the sum over k needs no (T*k, H)
    buffer, or stored per pair for ``_sum_k_kernel`` (deterministic); the launch configuration
    chooses (``MoEConfig.atomic_sum``).

Both GEMMs load their weight tiles by pointers or, where the configuration asks
(``GemmConfig.tma``) and the GPU has a copy engine, through a TMA tensor descriptor
(``weight_descriptor``; pointer loads remain the portable path). With ``Alignment.pair_blocks``
(decode) every block is one pair, read straight from topk_ids: no alignment launch.
On an sm_90 GPU a configuration may hand either GEMM to a warp-specialised Gluon kernel
instead (``GemmConfig.hopper``, ``kernels.hopper_w13`` and ``kernels.hopper_w2``: same inputs
and outputs, LoRA from the separate shrink); everywhere else these kernels run it.

Where the LoRA shrink runs is a launch-configuration choice per GEMM (``GemmConfig.fused_shrink``):
in the separate launch (one read of the block's rows and A matrices per block) or inside the
GEMM's main loop, as a second dot on the x tiles it loads anyway, in the first tile of each
program (no launch, no serial K loop over a handful of blocks; but every program of a block
repeats it: on an H100 it pays at about one row per expert, see kernels/BENCHMARKS.md). The
expand is a small dot in the GEMM epilogue. Only rank-R vectors per row go through memory,
and every sum has a fixed order (but a shrink split in three or more parts).

A block may hold rows of several adapter slots ("segments", numbered by slot). The shrink
handles up to ``MoEConfig.lora_segments`` segments (in the main loop: ``segments_per_pass``)
with *one* dot against their A matrices stacked side by side, each row keeping the rank-R slice
of its own segment (``_collapse``), so x is read once per that many segments. The expands take
one small dot per segment, which keeps the GEMM epilogues' registers free for the accumulator.
Ranks above ``MAX_REGISTER_RANK`` go 64 at a time (the separate shrink, then the expand from
memory), so any rank fits in shared memory and registers.

Dtypes: bf16/fp16 operands with fp32 accumulation (the rank-R vectors and ``a`` are rounded
to the operand dtype before their dots, as in every fused MoE); fp32 operands use exact IEEE
dots. FP8 experts (float8_e4m3fn W13 and W2 with float32 scales per 128×128 block,
``kernels.fp8``) run W8A16, with the activations in the compute dtype: the main loop loads the
weight tile by pointers (no TMA) and, as ``GemmConfig.fp8_dequant`` says, either converts it
exactly to x's dtype for the dot and multiplies each K step's product by its output columns'
scales before adding it to the fp32 accumulator (vLLM's block-FP8 method without quantising x),
or dequantises the tile itself (q·scale in fp32, rounded to x's dtype, as the reference
dequantises) and accumulates in the dot. With ``GemmConfig.fp8_activations`` the GEMM's input
is quantised first (``kernels.fp8_activations``: a scale per row and 128 columns) and the FP8
tensor cores take both tiles (W8A8), each step's product scaled by its rows' and columns'
scales; the LoRA then reads the unquantised input through the separate shrink. BLOCK_K
divides 128, so a step lies in one scale block (``kernels.configs.fit_stages`` sees to it).
The LoRA dots, biases and the rest stay in the compute dtype.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.align import Alignment, pair_slots
from kernels.configs import (
    MAX_REGISTER_RANK,
    GemmConfig,
    MoEConfig,
    padded_rank,
    segments_per_pass,
)
from kernels.fp8_activations import quantize_activations
from kernels.hopper_gemm import hopper_takes, on_hopper
from kernels.hopper_w2 import w2_stage_hopper
from kernels.hopper_w13 import w13_stage_hopper
from kernels.types import FP8_BLOCK, Activation

_CLEAR_BLOCK = 1024  # elements each w13 program zeroes per step of the output clear
_FP8_BLOCK = tl.constexpr(FP8_BLOCK)  # rows and columns of FP8 weight sharing one scale
#: The kernels' FP8 mode (0: the weights are not FP8): scale each product, or dequantise the tile.
FP8_SCALE_PRODUCT = tl.constexpr(1)
FP8_DEQUANT = tl.constexpr(2)
#: FP8 weights and FP8 activations (a float32 scale per row and 128 columns): FP8 dots.
FP8_W8A8 = tl.constexpr(3)
_SHRINK_BLOCK_K = 128  # reduction step of the shrink kernel
_SHRINK_SUB_M = 64  # rows per shrink program
_SHRINK_STACK = 128  # widest stacked A operand (segments × ranks) of the shrink kernel


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL) a kernel is launched while the one before it
    still runs: wait here for that kernel's writes (everything this one reads comes from it
    or earlier), then let the next kernel launch in turn. Its programs start once all of
    ours have, so they take no place from ours; they overlap our last wave's tail."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _program_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(M block, N program) of program ``pid`` of a 1-D grid, in grouped order: the programs
    of GROUP_M consecutive blocks (all their N programs, block index fastest) run next to each
    other, so a block's rows and an expert's weight tiles are reused from L2 while they are
    there. GROUP_M = 0: one group of all blocks."""
    if GROUP_M == 0:
        return pid % num_m, pid // num_m
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % group_size, local // group_size


@triton.jit
def _block_pairs(pair_ids_ptr, block, rows, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """The pair in each of the block's ``rows`` (-1: padding): the alignment's, or with
    PAIR_BLOCKS block b is pair b alone, in its first row."""
    if PAIR_BLOCKS:
        return tl.where(rows == block * BLOCK_M, block, -1)
    return tl.load(pair_ids_ptr + rows)


@triton.jit
def _row_slots(row_slots_ptr, enabled_ptr, rows, pair, top_k, PAIR_BLOCKS: tl.constexpr):
    """Each row's effective adapter slot (-1: none): the alignment's row_slots, or with
    PAIR_BLOCKS looked up per pair (``row_slots_ptr`` then holds the token slots)."""
    if PAIR_BLOCKS:
        return pair_slots(row_slots_ptr, enabled_ptr, pair, pair >= 0, top_k)
    return tl.load(row_slots_ptr + rows)


@triton.jit
def _block_segments(slot, S_P2: tl.constexpr):
    """Each row's segment (index of its slot among the slots present in the rows, -1 without
    LoRA) and the number of segments."""
    hit = slot[:, None] == tl.arange(0, S_P2)[None, :]
    present = tl.max(hit.to(tl.int32), axis=0)
    index = tl.cumsum(present, 0) - 1
    seg = tl.sum(tl.where(hit, index[None, :], 0), axis=1)
    return tl.where(slot >= 0, seg, -1), tl.sum(present, axis=0)


@triton.jit
def _segment_columns(slot, seg, chunk, r0, R, NSEG: tl.constexpr, RC: tl.constexpr):
    """For the stacked LoRA dot of segments chunk*NSEG.. over ranks r0..r0+RC: the slot and
    rank index of each of its NSEG*RC columns, and which columns are real (a segment that
    exists, r < R)."""
    target = chunk * NSEG + tl.arange(0, NSEG)
    seg_slot = tl.max(tl.where(seg[:, None] == target[None, :], slot[:, None], -1), axis=0)
    col_slot = tl.reshape(tl.broadcast_to(seg_slot[:, None], (NSEG, RC)), (NSEG * RC,))
    col_rank = r0 + tl.arange(0, NSEG * RC) % RC
    return col_slot.to(tl.int64), col_rank, (col_slot >= 0) & (col_rank < R)


@triton.jit
def _collapse(xa_stacked, seg, chunk, BLOCK_M: tl.constexpr, NSEG: tl.constexpr, RP: tl.constexpr):
    """(BLOCK_M, NSEG*RP) → (BLOCK_M, RP): each row keeps the slice of its own segment."""
    x3 = tl.reshape(xa_stacked, (BLOCK_M, NSEG, RP))
    target = chunk * NSEG + tl.arange(0, NSEG)
    mine = seg[:, None, None] == target[None, :, None]
    return tl.sum(tl.where(mine, x3, 0.0), axis=1)


@triton.jit
def _main_loop(
    acc,
    x_row_ptrs,
    x_row_mask,
    xs_row_ptrs,
    w_cols,
    w_col_mask,
    w_desc,
    expert,
    w_row,
    k_base,
    a_cols,
    a_col_mask,
    s_cols,
    stride_sk,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHRINK_N: tl.constexpr,
    WITH_SHRINK: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + x·Wᵀ of one tile in fp32; WITH_SHRINK also x·Aᵀ (BLOCK_M, SHRINK_N) for the
    stacked LoRA A rows ``a_cols``, from the same x tiles. x_row_ptrs (BLOCK_M,), w_cols (BLOCK_N,)
    and a_cols (SHRINK_N,) point at the first k (``k_base``) of each row of x, W and A; K (the
    length of the reduction from there) is contiguous in all.
    W_TMA (0: pointer loads; else the descriptor's rank): W comes through the tensor
    descriptor ``w_desc`` (E, N, K), block (1, BLOCK_N, BLOCK_K), from row ``w_row``, column
    ``k_base`` of the expert's (N, K) (the copy engine; out of range reads as zeros), instead of
    ``w_cols``; for W13 (E, 2, I, K) with block (1, 2, BLOCK_N / 2, BLOCK_K): gate rows
    w_row.. then up rows w_row..
    FP8 (pointer loads only; BLOCK_K divides 128, so a K step lies in one scale block): W is
    float8_e4m3fn with its columns' scales, s_cols (BLOCK_N,) pointing at each column's scale of
    the first K block, the K blocks ``stride_sk`` apart. FP8 == FP8_SCALE_PRODUCT: the tile is
    converted (exactly) to x's dtype and each step's product multiplied by the scales;
    FP8 == FP8_DEQUANT: the tile is dequantised (q·scale in fp32, rounded to x's dtype) and the
    dot accumulates. FP8 == FP8_W8A8: x is float8_e4m3fn too, xs_row_ptrs (BLOCK_M,) pointing
    at each row's scale of the first K block (the next block's follows it): the FP8 tensor
    cores take both tiles and each step's product is scaled by its rows' and columns' scales.
    """
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_row_ptrs[:, None] + offs_k[None, :]
    w_ptrs = w_cols[None, :] + offs_k[:, None]
    a_ptrs = a_cols[None, :] + offs_k[:, None]
    xa = tl.zeros((BLOCK_M, SHRINK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=x_row_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=x_row_mask[:, None] & k_mask[None, :], other=0.0)
        if W_TMA == 4:  # W13 as (E, 2, I, K): gate rows, then up rows
            w = w_desc.load([expert.to(tl.int32), 0, w_row, k_base + k0])
            w = w.reshape(BLOCK_N, BLOCK_K).T
        elif W_TMA == 3:
            w = w_desc.load([expert.to(tl.int32), w_row, k_base + k0])
            w = w.reshape(BLOCK_N, BLOCK_K).T
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=w_col_mask[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=w_col_mask[None, :] & k_mask[:, None], other=0.0)
        if FP8:
            k_block = (k_base + k0) // _FP8_BLOCK
            scale = tl.load(s_cols + k_block * stride_sk, mask=w_col_mask, other=0.0)
            if FP8 == FP8_W8A8:
                x_scale = tl.load(xs_row_ptrs + k_block, mask=x_row_mask, other=0.0)
                acc += tl.dot(x, w) * (x_scale[:, None] * scale[None, :])
            elif FP8 == FP8_DEQUANT:
                w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            else:
                acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * scale[None, :]
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if WITH_SHRINK:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=a_col_mask[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=a_col_mask[None, :] & k_mask[:, None], other=0.0)
            xa = tl.dot(x, a, xa, input_precision=PRECISION)
            a_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, xa


@triton.jit
def _shrink_rows(
    x_row_ptrs,
    x_row_mask,
    a_ptr,
    expert,
    slot,
    seg,
    n_seg,
    first_chunk,
    r0,
    K,
    R,
    stride_as,
    stride_ae,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """x·A[s, e]ᵀ (BLOCK_M, RC) fp32 over ranks r0..r0+RC of the rows of segments
    first_chunk*NSEG.. (0 for the others): per pass of NSEG segments one K loop, with their A
    matrices stacked side by side in one dot, each row keeping the slice of its own segment.
    Passes outside, K inside: the K loop is the one that gets pipelined."""
    offs_k = tl.arange(0, BLOCK_K)
    xa = tl.zeros((BLOCK_M, RC), dtype=tl.float32)
    for chunk in range(first_chunk, tl.cdiv(n_seg, NSEG)):
        col_slot, col_rank, col_ok = _segment_columns(slot, seg, chunk, r0, R, NSEG, RC)
        a_cols = a_ptr + expert * stride_ae + col_slot * stride_as + col_rank * stride_ar
        stacked = tl.zeros((BLOCK_M, NSEG * RC), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            x = tl.load(
                x_row_ptrs[:, None] + (k0 + offs_k)[None, :],
                mask=x_row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                a_cols[None, :] + (k0 + offs_k)[:, None],
                mask=col_ok[None, :] & k_mask[:, None],
                other=0.0,
            )
            stacked = tl.dot(x, a, stacked, input_precision=PRECISION)
        xa += _collapse(stacked, seg, chunk, BLOCK_M, NSEG, RC)
    return xa


@triton.jit
def _lora_expand(
    acc,
    xa,
    slot,
    seg,
    n_seg,
    b_ptr,
    expert,
    b_rows,
    col_mask,
    R,
    stride_bs,
    stride_be,
    stride_br,
    RP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc += each row's xa (BLOCK_M, RP) times its slot's B[s, e] rows ``b_rows`` (offsets of
    the tile's output columns in B): one small dot per segment, with the other rows' xa
    zeroed. One segment at a time keeps the epilogue's registers to 2-D (BLOCK_M, RP) and
    (RP, BLOCK_N) tiles next to the live accumulator (a stacked K = segments·RP dot was
    slower on an H100: its B tile spilled next to a 128×256 accumulator)."""
    ranks = tl.arange(0, RP)
    for j in range(0, n_seg):
        seg_slot = tl.max(tl.where(seg == j, slot, -1), axis=0).to(tl.int64)
        b_seg = b_ptr + expert * stride_be + seg_slot * stride_bs
        b = tl.load(
            b_seg + ranks[:, None] * stride_br + b_rows[None, :],
            mask=(ranks < R)[:, None] & col_mask[None, :],
            other=0.0,
        )
        mine = tl.where((seg == j)[:, None], xa, 0.0).to(b.dtype)
        acc = tl.dot(mine, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _fused_tile(
    acc,
    xa,
    is_first_tile,
    x_row_ptrs,
    x_row_mask,
    w_cols,
    col_mask,
    w_desc,
    w_row,
    k_base,
    s_cols,
    stride_sk,
    a_ptr,
    b_ptr,
    b_rows,
    expert,
    slot,
    seg,
    n_seg,
    K,
    R,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + x·Wᵀ + LoRA of one tile with the shrink fused: the program's first tile computes
    the rows' x·A[s, e]ᵀ ``xa`` in its main loop (the first NSEG segments; further ones, rare,
    in extra K loops); later tiles pass ``xa`` through. Returns the tile and ``xa``. The whole
    padded rank RP (at most ``MAX_REGISTER_RANK``) is held in registers."""
    if is_first_tile:
        col_slot, col_rank, col_ok = _segment_columns(slot, seg, 0, 0, R, NSEG, RP)
        a_cols = a_ptr + expert * stride_ae + col_slot * stride_as + col_rank * stride_ar
        tl.static_assert(FP8 != FP8_W8A8, "FP8 activations leave the shrink unfused")
        acc, stacked = _main_loop(
            acc, x_row_ptrs, x_row_mask, x_row_ptrs, w_cols, col_mask, w_desc, expert, w_row,
            k_base, a_cols, col_ok, s_cols, stride_sk, K, BLOCK_M, BLOCK_N, BLOCK_K, NSEG * RP,
            True, EVEN_K, W_TMA, FP8, PRECISION,
        )  # fmt: skip
        xa = _collapse(stacked, seg, 0, BLOCK_M, NSEG, RP) + _shrink_rows(
            x_row_ptrs, seg >= 0, a_ptr, expert, slot, seg, n_seg, 1, 0, K, R,
            stride_as, stride_ae, stride_ar, BLOCK_M, BLOCK_K, NSEG, RP, PRECISION,
        )  # fmt: skip
    else:
        acc, _ = _main_loop(
            acc, x_row_ptrs, x_row_mask, x_row_ptrs, w_cols, col_mask, w_desc, expert, w_row,
            k_base, w_cols, col_mask, s_cols, stride_sk, K, BLOCK_M, BLOCK_N, BLOCK_K, 16, False,
            EVEN_K, W_TMA, FP8, PRECISION,
        )  # fmt: skip
    return _lora_expand(
        acc, xa, slot, seg, n_seg, b_ptr, expert, b_rows, col_mask, R,
        stride_bs, stride_be, stride_br, RP, PRECISION,
    ), xa  # fmt: skip


@triton.jit
def _gemm_tile(
    acc,
    xa,
    is_first_tile,
    x_row_ptrs,
    x_row_mask,
    xs_row_ptrs,
    w_cols,
    out_cols,
    col_mask,
    w_desc,
    w_row,
    k_base,
    scale_ptr,
    a_ptr,
    xa_ptr,
    b_ptr,
    bias_ptr,
    row_slots_ptr,
    enabled_ptr,
    row0,
    pair,
    top_k,
    expert,
    slot,
    seg,
    n_seg,
    K,
    R,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_bias,
    stride_se,
    stride_sn,
    stride_sk,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    FUSED_SHRINK: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    RC: tl.constexpr,
    S_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One output tile of either GEMM: acc + x·Wᵀ (+ LoRA) (+ bias) in fp32, for the weight
    rows ``out_cols`` (W13's gate/up rows in the tile's order, or W2's columns), over K
    columns from ``k_base`` (w2's split K: every part adds its share of the product, the
    first part the bias and, from the separate shrink, the LoRA; a fused shrink's partial
    x·Aᵀ of the part goes through B — the expand is linear). With the shrink fused the first
    tile of the program computes ``xa`` (passed on to later tiles); else the rows' xa comes
    from the separate shrink launch, RC ranks at a time. Returns the tile and ``xa``.
    FP8: ``scale_ptr`` (E, N / 128, K / 128) holds W's block scales; FP8_W8A8: x is FP8,
    ``xs_row_ptrs`` its rows' scales (see ``_main_loop``)."""
    b_rows = out_cols * stride_bn
    if FP8:
        s_cols = scale_ptr + expert * stride_se + (out_cols // _FP8_BLOCK) * stride_sn
    else:
        s_cols = scale_ptr  # unread
    if FUSED_SHRINK:
        acc, xa = _fused_tile(
            acc, xa, is_first_tile, x_row_ptrs, x_row_mask, w_cols, col_mask, w_desc, w_row,
            k_base, s_cols, stride_sk, a_ptr, b_ptr, b_rows, expert, slot, seg, n_seg, K, R,
            stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_br,
            BLOCK_M, BLOCK_N, BLOCK_K, NSEG, RP, EVEN_K, W_TMA, FP8, PRECISION,
        )  # fmt: skip
    else:
        acc, _ = _main_loop(
            acc, x_row_ptrs, x_row_mask, xs_row_ptrs, w_cols, col_mask, w_desc, expert, w_row,
            k_base, w_cols, col_mask, s_cols, stride_sk, K, BLOCK_M, BLOCK_N, BLOCK_K, 16, False,
            EVEN_K, W_TMA, FP8, PRECISION,
        )  # fmt: skip
        if HAS_LORA and k_base == 0:  # split K: the first part adds the whole LoRA
            # Loaded after the main loop, so they take no registers while it runs.
            rows = row0 + tl.arange(0, BLOCK_M)
            slot = _row_slots(row_slots_ptr, enabled_ptr, rows, pair, top_k, PAIR_BLOCKS)
            seg, n_seg = _block_segments(slot, S_P2)
            for r0 in tl.static_range(0, RP, RC):
                xa_rows = tl.load(xa_ptr + rows[:, None] * RP + r0 + tl.arange(0, RC)[None, :])
                acc = _lora_expand(
                    acc, xa_rows, slot, seg, n_seg, b_ptr + r0 * stride_br, expert, b_rows,
                    col_mask, R - r0, stride_bs, stride_be, stride_br, RC, PRECISION,
                )  # fmt: skip
    if HAS_BIAS and k_base == 0:
        bias = tl.load(bias_ptr + expert * stride_bias + out_cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    return acc, xa


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # GATHER: (T, K) hidden states, row of token; else (max_rows, K) aligned rows
    a_ptr,  # (S, E, R, K) LoRA A
    xa_ptr,  # (max_rows, RP) out, operand dtype: x·A[s, e]ᵀ per aligned row
    pair_ids_ptr,
    row_slots_ptr,
    enabled_ptr,  # PAIR_BLOCKS: the slots' enabled flags (row_slots_ptr: token slots)
    block_experts_ptr,
    K,
    K_PART,  # PARTS > 1: columns of K per part (a multiple of BLOCK_K)
    top_k,
    R,
    stride_x,
    stride_as,
    stride_ae,
    stride_ar,
    GATHER: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # the alignment's block
    SUB_M: tl.constexpr,  # rows per program: a part of a block
    BLOCK_K: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    RC: tl.constexpr,  # ranks per pass: the accumulator is (SUB_M, NSEG*RC)
    S_P2: tl.constexpr,
    PARTS: tl.constexpr,  # programs per SUB_M rows, each over K_PART columns of K
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per SUB_M rows of a block (and part of K): its segments are only those of
    its rows, and the register tile stays (SUB_M, NSEG*RC) whatever the rank. With PARTS > 1
    each part adds its float32 partial sum into xa (zeroed) atomically."""
    _wait_for_inputs(PDL)
    pid = tl.program_id(0)
    part = pid % PARTS
    pid = pid // PARTS
    k_lo = part * K_PART
    block = pid // (BLOCK_M // SUB_M)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    row0 = block * BLOCK_M + (pid % (BLOCK_M // SUB_M)) * SUB_M
    rows = row0 + tl.arange(0, SUB_M)
    pair = _block_pairs(pair_ids_ptr, block, rows, BLOCK_M, PAIR_BLOCKS)
    slot = _row_slots(row_slots_ptr, enabled_ptr, rows, pair, top_k, PAIR_BLOCKS)
    seg, n_seg = _block_segments(slot, S_P2)
    if GATHER:
        x_row_ptrs = x_ptr + (tl.maximum(pair, 0) // top_k).to(tl.int64) * stride_x + k_lo
    else:
        x_row_ptrs = x_ptr + rows.to(tl.int64) * stride_x + k_lo
    k_len = tl.minimum(K_PART, K - k_lo) if PARTS > 1 else K
    for r0 in tl.static_range(0, RP, RC):
        # Rows without an adapter (padding included) read nothing and store zeros.
        xa = _shrink_rows(
            x_row_ptrs, seg >= 0, a_ptr + k_lo, expert, slot, seg, n_seg, 0, r0, k_len, R,
            stride_as, stride_ae, stride_ar, SUB_M, BLOCK_K, NSEG, RC, PRECISION,
        )  # fmt: skip
        out = xa_ptr + rows[:, None] * RP + r0 + tl.arange(0, RC)[None, :]
        if PARTS > 1:
            tl.atomic_add(out, xa, sem="relaxed")
        else:
            tl.store(out, xa.to(xa_ptr.dtype.element_ty))


@triton.jit
def _w13_work(
    pid,
    x_ptr,  # (T, H) hidden states; FP8_W8A8: float8_e4m3fn
    xs_ptr,  # FP8_W8A8: (T, ceil(H/128)) float32 scales of x's row groups; else unused
    w_ptr,  # (E, 2I, H), FP8: float8_e4m3fn
    w_desc,  # W_TMA: a tensor descriptor of w seen as (E, 2, I, H), block (1, 2, BLOCK_N,
    # BLOCK_K); else unused
    scale_ptr,  # FP8: (E, ceil(2I/128), ceil(H/128)) float32 block scales of w; else unused
    bias_ptr,  # (E, 2I) or unused
    a_ptr,  # (S, E, R, H) LoRA A13 (FUSED_SHRINK) or unused
    xa_ptr,  # (max_rows, RP) x·A13ᵀ from _lora_shrink_kernel, or unused (FUSED_SHRINK)
    b_ptr,  # (S, E, 2I, R) LoRA B13
    out_ptr,  # (max_rows, I) activation, aligned row order
    pair_ids_ptr,
    row_slots_ptr,  # PAIR_BLOCKS: the token slots
    enabled_ptr,  # PAIR_BLOCKS: the slots' enabled flags, or unused
    block_experts_ptr,  # PAIR_BLOCKS: topk_ids, the expert of each pair
    num_blocks,
    H,
    inter,
    top_k,
    R,
    alpha,
    limit,
    stride_xt,
    stride_xs,
    stride_we,
    stride_wn,
    stride_bias,
    stride_se,
    stride_sn,
    stride_sk,
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
    FUSED_SHRINK: tl.constexpr,  # implies HAS_LORA
    PAIR_BLOCKS: tl.constexpr,  # every block is one pair, in its first row (no alignment)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    GROUP_M: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    RC: tl.constexpr,
    S_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,  # 0 (w is not FP8) or the FP8 main loop (see _main_loop)
    PRECISION: tl.constexpr,
):
    """Program ``pid``'s work of ``_w13_kernel``: its N tiles of one block."""
    num_tiles = tl.cdiv(inter, BLOCK_N)
    num_n = tl.cdiv(num_tiles, TILES_PER_PROGRAM)
    pid_m, pid_n = _program_tile(pid, num_blocks, num_n, GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert >= 0:  # else a padding block
        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        pair = _block_pairs(pair_ids_ptr, pid_m, rows, BLOCK_M, PAIR_BLOCKS)
        x_row_mask = pair >= 0
        token = (tl.maximum(pair, 0) // top_k).to(tl.int64)
        x_row_ptrs = x_ptr + token * stride_xt
        xs_row_ptrs = xs_ptr + token * stride_xs
        if FUSED_SHRINK:
            # The rows' adapter segments; x·Aᵀ comes from the first tile's main loop.
            slot = _row_slots(row_slots_ptr, enabled_ptr, rows, pair, top_k, PAIR_BLOCKS)
            seg, n_seg = _block_segments(slot, S_P2)
        else:
            slot, seg, n_seg = pair, pair, 0  # unused: the tile reads them after its main loop
        xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)

        # Pointer loads: tile columns interleave gate and up, column c is gate (c even) or up
        # (c odd) of intermediate index n0 + c // 2, i.e. row (n0 + c // 2) + (c % 2) * I of W13.
        # TMA: one box of W13 seen as (E, 2, I, H) holds gate rows n0.. then up rows n0..: the
        # columns are [gate | up] halves.
        cols = tl.arange(0, 2 * BLOCK_N)
        first = pid_n * TILES_PER_PROGRAM
        for tile in range(first, tl.minimum(first + TILES_PER_PROGRAM, num_tiles)):
            n0 = tile * BLOCK_N
            if W_TMA:
                inter_idx = n0 + cols % BLOCK_N
                w13_rows = inter_idx + (cols // BLOCK_N) * inter
            else:
                inter_idx = n0 + cols // 2
                w13_rows = inter_idx + (cols % 2) * inter
            col_mask = inter_idx < inter
            w_cols = w_ptr + expert * stride_we + w13_rows.to(tl.int64) * stride_wn
            acc, xa = _gemm_tile(
                tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32), xa, tile == first, x_row_ptrs,
                x_row_mask, xs_row_ptrs, w_cols, w13_rows, col_mask, w_desc, n0, 0, scale_ptr,
                a_ptr, xa_ptr, b_ptr, bias_ptr, row_slots_ptr, enabled_ptr, row0, pair, top_k,
                expert, slot, seg, n_seg, H, R, stride_as, stride_ae, stride_ar, stride_bs,
                stride_be, stride_bn, stride_br, stride_bias, stride_se, stride_sn, stride_sk,
                HAS_BIAS, HAS_LORA, FUSED_SHRINK, PAIR_BLOCKS, BLOCK_M, 2 * BLOCK_N, BLOCK_K, NSEG,
                RP, RC, S_P2, EVEN_K, W_TMA, FP8, PRECISION,
            )  # fmt: skip
            if W_TMA:
                acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
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
def _w13_kernel(
    x_ptr,  # (T, H) hidden states; FP8_W8A8: float8_e4m3fn
    xs_ptr,  # FP8_W8A8: (T, ceil(H/128)) float32 scales of x's row groups; else unused
    w_ptr,  # (E, 2I, H), FP8: float8_e4m3fn
    w_desc,  # W_TMA: a tensor descriptor of w seen as (E, 2, I, H), block (1, 2, BLOCK_N,
    # BLOCK_K); else unused
    scale_ptr,  # FP8: (E, ceil(2I/128), ceil(H/128)) float32 block scales of w; else unused
    bias_ptr,  # (E, 2I) or unused
    a_ptr,  # (S, E, R, H) LoRA A13 (FUSED_SHRINK) or unused
    xa_ptr,  # (max_rows, RP) x·A13ᵀ from _lora_shrink_kernel, or unused (FUSED_SHRINK)
    b_ptr,  # (S, E, 2I, R) LoRA B13
    out_ptr,  # (max_rows, I) activation, aligned row order
    pair_ids_ptr,
    row_slots_ptr,  # PAIR_BLOCKS: the token slots
    enabled_ptr,  # PAIR_BLOCKS: the slots' enabled flags, or unused
    block_experts_ptr,  # PAIR_BLOCKS: topk_ids, the expert of each pair
    clear_ptr,  # float32 buffer zeroed on the side (the w2 sum), or unused
    clear_numel,
    clear_per_program,
    num_blocks,
    H,
    inter,
    top_k,
    R,
    alpha,
    limit,
    stride_xt,
    stride_xs,
    stride_we,
    stride_wn,
    stride_bias,
    stride_se,
    stride_sn,
    stride_sk,
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
    FUSED_SHRINK: tl.constexpr,  # implies HAS_LORA
    PAIR_BLOCKS: tl.constexpr,  # every block is one pair, in its first row (no alignment)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    GROUP_M: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    RC: tl.constexpr,
    S_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,  # 0 (w is not FP8) or the FP8 main loop (see _main_loop)
    PRECISION: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
    PERSISTENT: tl.constexpr,  # a program per SM (or so) loops over the work
    PDL: tl.constexpr,
):
    _wait_for_inputs(PDL)
    # The w2 kernel may add into a zeroed fp32 buffer; clearing it here saves a memset launch.
    clear_start = tl.program_id(0) * clear_per_program
    clear_end = tl.minimum(clear_start + clear_per_program, clear_numel)
    for c0 in range(clear_start, clear_end, CLEAR_BLOCK):
        offs = c0 + tl.arange(0, CLEAR_BLOCK)
        tl.store(clear_ptr + offs, 0.0, mask=offs < clear_end)

    num_work = num_blocks * tl.cdiv(tl.cdiv(inter, BLOCK_N), TILES_PER_PROGRAM)
    if PERSISTENT:
        for pid in range(tl.program_id(0), num_work, tl.num_programs(0)):
            _w13_work(
                pid, x_ptr, xs_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, a_ptr, xa_ptr, b_ptr,
                out_ptr, pair_ids_ptr, row_slots_ptr, enabled_ptr, block_experts_ptr, num_blocks, H,
                inter, top_k, R, alpha, limit, stride_xt, stride_xs, stride_we, stride_wn,
                stride_bias, stride_se, stride_sn, stride_sk, stride_as, stride_ae, stride_ar,
                stride_bs, stride_be, stride_bn, stride_br, stride_om, ACTIVATION, HAS_BIAS,
                HAS_LORA, FUSED_SHRINK, PAIR_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, TILES_PER_PROGRAM,
                GROUP_M, NSEG, RP, RC, S_P2, EVEN_K, W_TMA, FP8, PRECISION,
            )  # fmt: skip
    else:
        pid = tl.program_id(0)
        _w13_work(
            pid, x_ptr, xs_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, a_ptr, xa_ptr, b_ptr, out_ptr,
            pair_ids_ptr, row_slots_ptr, enabled_ptr, block_experts_ptr, num_blocks, H,
            inter, top_k, R, alpha, limit, stride_xt, stride_xs, stride_we, stride_wn, stride_bias,
            stride_se, stride_sn, stride_sk, stride_as, stride_ae, stride_ar, stride_bs,
            stride_be, stride_bn, stride_br, stride_om, ACTIVATION, HAS_BIAS, HAS_LORA,
            FUSED_SHRINK, PAIR_BLOCKS, BLOCK_M, BLOCK_N, BLOCK_K, TILES_PER_PROGRAM,
            GROUP_M, NSEG, RP, RC, S_P2, EVEN_K, W_TMA, FP8, PRECISION,
        )  # fmt: skip


@triton.jit
def _w2_work(
    pid,
    act_ptr,  # (max_rows, I) activation from _w13_kernel; FP8_W8A8: quantised, float8_e4m3fn
    xs_ptr,  # FP8_W8A8: (max_rows, ceil(I/128)) float32 scales of act's row groups; else unused
    w_ptr,  # (E, H, I), FP8: float8_e4m3fn
    w_desc,  # W_TMA: a tensor descriptor of w, block (1, BLOCK_N, BLOCK_K); else unused
    scale_ptr,  # FP8: (E, ceil(H/128), ceil(I/128)) float32 block scales of w; else unused
    bias_ptr,  # (E, H) or unused
    a_ptr,  # (S, E, R, I) LoRA A2 (FUSED_SHRINK) or unused
    xa_ptr,  # (max_rows, RP) a·A2ᵀ from _lora_shrink_kernel, or unused (FUSED_SHRINK)
    b_ptr,  # (S, E, H, R) LoRA B2
    out_ptr,  # ATOMIC_SUM: (T, H) fp32 zeroed by _w13_kernel; else (T*k, H), row per pair
    pair_ids_ptr,
    row_slots_ptr,  # PAIR_BLOCKS: the token slots
    enabled_ptr,  # PAIR_BLOCKS: the slots' enabled flags, or unused
    block_experts_ptr,  # PAIR_BLOCKS: topk_ids, the expert of each pair
    topk_weights_ptr,  # (T*k,) fp32
    num_blocks,
    H,
    inter,
    k_split,  # SPLIT_K > 1: K columns per part, a multiple of BLOCK_K
    top_k,
    R,
    stride_am,
    stride_xs,
    stride_we,
    stride_wn,
    stride_bias,
    stride_se,
    stride_sn,
    stride_sk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_out,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    FUSED_SHRINK: tl.constexpr,  # implies HAS_LORA
    ATOMIC_SUM: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,  # every block is one pair, in its first row (no alignment)
    SPLIT_K: tl.constexpr,  # parts of K, each a program adding its share (implies ATOMIC_SUM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    GROUP_M: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    RC: tl.constexpr,
    S_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,  # 0 (w is not FP8) or the FP8 main loop (see _main_loop)
    PRECISION: tl.constexpr,
):
    """Program ``pid``'s work of ``_w2_kernel``: its N tiles of one block (one part of K)."""
    num_tiles = tl.cdiv(H, BLOCK_N)
    # Split K: the parts of one tile are neighbouring programs, so its rows stay in L2.
    k_base = (pid % SPLIT_K) * k_split
    k_len = inter
    if SPLIT_K > 1:
        k_len = tl.minimum(k_split, inter - k_base)
    num_n = tl.cdiv(num_tiles, TILES_PER_PROGRAM)
    pid_m, pid_n = _program_tile(pid // SPLIT_K, num_blocks, num_n, GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert >= 0:  # else a padding block
        row0 = pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        pair = _block_pairs(pair_ids_ptr, pid_m, rows, BLOCK_M, PAIR_BLOCKS)
        valid = pair >= 0
        # Padding rows of the activation were written by _w13_kernel (finite): no mask needed.
        x_row_mask = rows >= 0
        x_row_ptrs = act_ptr + rows.to(tl.int64) * stride_am + k_base
        xs_row_ptrs = xs_ptr + rows.to(tl.int64) * stride_xs  # the main loop adds K's block
        routed_weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)
        if ATOMIC_SUM:
            out_rows = out_ptr + (pair // top_k).to(tl.int64) * stride_out
        else:
            out_rows = out_ptr + pair.to(tl.int64) * stride_out
        if FUSED_SHRINK:
            # The rows' adapter segments; x·Aᵀ comes from the first tile's main loop.
            slot = _row_slots(row_slots_ptr, enabled_ptr, rows, pair, top_k, PAIR_BLOCKS)
            seg, n_seg = _block_segments(slot, S_P2)
        else:
            slot, seg, n_seg = pair, pair, 0  # unused: the tile reads them after its main loop
        xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)

        first = pid_n * TILES_PER_PROGRAM
        for tile in range(first, tl.minimum(first + TILES_PER_PROGRAM, num_tiles)):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < H
            w_cols = w_ptr + expert * stride_we + cols.to(tl.int64) * stride_wn + k_base
            acc, xa = _gemm_tile(
                tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), xa, tile == first, x_row_ptrs,
                x_row_mask, xs_row_ptrs, w_cols, cols, col_mask, w_desc, tile * BLOCK_N, k_base,
                scale_ptr, a_ptr + k_base, xa_ptr, b_ptr, bias_ptr, row_slots_ptr, enabled_ptr,
                row0, pair, top_k, expert, slot, seg, n_seg, k_len, R, stride_as, stride_ae,
                stride_ar, stride_bs, stride_be, stride_bn, stride_br, stride_bias, stride_se,
                stride_sn, stride_sk, HAS_BIAS, HAS_LORA, FUSED_SHRINK, PAIR_BLOCKS, BLOCK_M,
                BLOCK_N, BLOCK_K, NSEG, RP, RC, S_P2, EVEN_K, W_TMA, FP8, PRECISION,
            )  # fmt: skip
            acc *= routed_weight[:, None]
            out_ptrs = out_rows[:, None] + cols[None, :]
            out_mask = valid[:, None] & col_mask[None, :]
            if ATOMIC_SUM:
                tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")
            else:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w2_kernel(
    act_ptr,  # (max_rows, I) activation from _w13_kernel; FP8_W8A8: quantised, float8_e4m3fn
    xs_ptr,  # FP8_W8A8: (max_rows, ceil(I/128)) float32 scales of act's row groups; else unused
    w_ptr,  # (E, H, I), FP8: float8_e4m3fn
    w_desc,  # W_TMA: a tensor descriptor of w, block (1, BLOCK_N, BLOCK_K); else unused
    scale_ptr,  # FP8: (E, ceil(H/128), ceil(I/128)) float32 block scales of w; else unused
    bias_ptr,  # (E, H) or unused
    a_ptr,  # (S, E, R, I) LoRA A2 (FUSED_SHRINK) or unused
    xa_ptr,  # (max_rows, RP) a·A2ᵀ from _lora_shrink_kernel, or unused (FUSED_SHRINK)
    b_ptr,  # (S, E, H, R) LoRA B2
    out_ptr,  # ATOMIC_SUM: (T, H) fp32 zeroed by _w13_kernel; else (T*k, H), row per pair
    pair_ids_ptr,
    row_slots_ptr,  # PAIR_BLOCKS: the token slots
    enabled_ptr,  # PAIR_BLOCKS: the slots' enabled flags, or unused
    block_experts_ptr,  # PAIR_BLOCKS: topk_ids, the expert of each pair
    topk_weights_ptr,  # (T*k,) fp32
    num_blocks,
    H,
    inter,
    k_split,  # SPLIT_K > 1: K columns per part, a multiple of BLOCK_K
    top_k,
    R,
    stride_am,
    stride_xs,
    stride_we,
    stride_wn,
    stride_bias,
    stride_se,
    stride_sn,
    stride_sk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_out,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    FUSED_SHRINK: tl.constexpr,  # implies HAS_LORA
    ATOMIC_SUM: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,  # every block is one pair, in its first row (no alignment)
    SPLIT_K: tl.constexpr,  # parts of K, each a program adding its share (implies ATOMIC_SUM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    GROUP_M: tl.constexpr,
    NSEG: tl.constexpr,
    RP: tl.constexpr,
    RC: tl.constexpr,
    S_P2: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr,
    FP8: tl.constexpr,  # 0 (w is not FP8) or the FP8 main loop (see _main_loop)
    PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,  # a program per SM (or so) loops over the work
    PDL: tl.constexpr,
):
    _wait_for_inputs(PDL)
    num_work = num_blocks * tl.cdiv(tl.cdiv(H, BLOCK_N), TILES_PER_PROGRAM) * SPLIT_K
    if PERSISTENT:
        for pid in range(tl.program_id(0), num_work, tl.num_programs(0)):
            _w2_work(
                pid, act_ptr, xs_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, a_ptr, xa_ptr, b_ptr,
                out_ptr, pair_ids_ptr, row_slots_ptr, enabled_ptr, block_experts_ptr,
                topk_weights_ptr, num_blocks, H, inter, k_split, top_k, R, stride_am, stride_xs,
                stride_we, stride_wn, stride_bias, stride_se, stride_sn, stride_sk, stride_as,
                stride_ae, stride_ar, stride_bs, stride_be, stride_bn, stride_br, stride_out,
                HAS_BIAS, HAS_LORA, FUSED_SHRINK, ATOMIC_SUM, PAIR_BLOCKS, SPLIT_K, BLOCK_M,
                BLOCK_N, BLOCK_K, TILES_PER_PROGRAM, GROUP_M, NSEG, RP, RC, S_P2, EVEN_K, W_TMA,
                FP8, PRECISION,
            )  # fmt: skip
    else:
        pid = tl.program_id(0)
        _w2_work(
            pid, act_ptr, xs_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, a_ptr, xa_ptr, b_ptr, out_ptr,
            pair_ids_ptr, row_slots_ptr, enabled_ptr, block_experts_ptr, topk_weights_ptr,
            num_blocks, H, inter, k_split, top_k, R, stride_am, stride_xs, stride_we, stride_wn,
            stride_bias, stride_se, stride_sn, stride_sk, stride_as, stride_ae, stride_ar,
            stride_bs, stride_be, stride_bn, stride_br, stride_out, HAS_BIAS, HAS_LORA,
            FUSED_SHRINK, ATOMIC_SUM, PAIR_BLOCKS, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K,
            TILES_PER_PROGRAM, GROUP_M, NSEG, RP, RC, S_P2, EVEN_K, W_TMA, FP8, PRECISION,
        )  # fmt: skip


@triton.jit
def _sum_k_kernel(
    y_ptr,  # (T, k, H): each pair's weighted expert output
    addend_ptr,  # (T, H) added before rounding (shared expert), or unused
    out_ptr,  # (T, H)
    H,
    TOP_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = Σ_j y[t, j] (+ addend[t]) in fp32, in a fixed order: deterministic."""
    _wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADDEND:
        acc += tl.load(addend_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LoRABuffers:
    """LoRA operands of one forward: the slot buffers and the per-row slots."""

    a13: torch.Tensor  # (S, E, R, H)
    b13: torch.Tensor  # (S, E, 2I, R)
    a2: torch.Tensor  # (S, E, R, I)
    b2: torch.Tensor  # (S, E, H, R)
    row_slots: torch.Tensor  # (max_rows,) from the alignment


def _lora_meta(lora_a: torch.Tensor) -> tuple[int, int]:
    """(RP, S_P2) of slot buffers (S, E, R, K): the rank padded to a power of two of at
    least 16 (tl.dot's minimum inner size), the slot count padded to a power of two."""
    num_slots, _, rank, _ = lora_a.shape
    return padded_rank(rank), triton.next_power_of_2(num_slots)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _fp8_mode(scale: torch.Tensor | None, cfg: GemmConfig) -> int:
    """The kernels' FP8 constexpr: 0 without scales (the weights are not FP8)."""
    if scale is None:
        return 0
    if cfg.fp8_activations:
        return int(FP8_W8A8)
    return int(FP8_DEQUANT) if cfg.fp8_dequant else int(FP8_SCALE_PRODUCT)


def _gemm_input(
    x: torch.Tensor, scale: torch.Tensor | None, cfg: GemmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the GEMM's x operand, its row-group scales): x quantised to FP8 where the launch runs
    W8A8 (``GemmConfig.fp8_activations``), else x itself and a placeholder never read."""
    if _fp8_mode(scale, cfg) == FP8_W8A8:
        assert not cfg.fused_shrink, "FP8 activations take the separate shrink"
        return quantize_activations(x)
    return x, x


def lora_shrink_stage(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    gather: bool,
    top_k: int,
    alignment: Alignment,
    lora: LoRABuffers,
    config: MoEConfig,
    gemm: GemmConfig,
) -> torch.Tensor:
    """x·A[s, e]ᵀ for every aligned row: (max_rows, RP) in x's dtype (the expand rounds it
    to that before its dot anyway), or float32 where ``gemm.shrink_split_k`` cuts K into
    parts that add their sums atomically.

    x: the hidden states (T, K), rows gathered by token (``gather``), or the aligned
    activation (max_rows, K); lora_a (S, E, R, K).
    """
    rp, s_p2 = _lora_meta(lora_a)
    rc = min(rp, MAX_REGISTER_RANK)
    block_m = alignment.block_m
    sub_m = min(block_m, _SHRINK_SUB_M)
    block_k = _SHRINK_BLOCK_K if x.element_size() == 2 else _SHRINK_BLOCK_K // 2
    k = x.shape[1]
    k_part = triton.cdiv(triton.cdiv(k, gemm.shrink_split_k), block_k) * block_k
    parts = triton.cdiv(k, k_part)
    rows = alignment.max_blocks * block_m
    if parts > 1:
        xa = torch.zeros((rows, rp), dtype=torch.float32, device=x.device)
    else:
        xa = torch.empty((rows, rp), dtype=x.dtype, device=x.device)
    _lora_shrink_kernel[(alignment.max_blocks * (block_m // sub_m) * parts,)](
        x, lora_a, xa, alignment.sorted_pair_ids, lora.row_slots, _enabled(alignment),
        alignment.block_experts, k, k_part, top_k, lora_a.shape[2],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        GATHER=gather, PAIR_BLOCKS=alignment.pair_blocks,
        BLOCK_M=block_m, SUB_M=sub_m, BLOCK_K=block_k,
        NSEG=max(1, min(config.lora_segments, _SHRINK_STACK // rc)), RP=rp, RC=rc, S_P2=s_p2,
        PARTS=parts, PRECISION=_dot_precision(x.dtype), **_pdl_launch(x.device),
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return xa


@dataclass(frozen=True)
class _LoRAArgs:
    """The LoRA arguments of one GEMM launch (placeholders without LoRA)."""

    a: torch.Tensor  # (S, E, R, K) A, read by the fused shrink
    xa: torch.Tensor  # (max_rows, RP) from the separate shrink, or a placeholder
    b: torch.Tensor  # (S, E, N, R) B
    row_slots: torch.Tensor
    rank: int
    rp: int
    rc: int  # ranks per expand dot
    s_p2: int
    nseg: int  # segments per pass of the fused shrink and of the expand
    fused: bool


def _lora_args(
    x: torch.Tensor,
    which: str,
    gather: bool,
    top_k: int,
    alignment: Alignment,
    lora: LoRABuffers | None,
    config: MoEConfig,
    gemm: GemmConfig,
) -> _LoRAArgs:
    """The LoRA arguments of GEMM ``which`` ("13" or "2"); runs the separate shrink launch
    unless ``gemm`` fuses it."""
    if lora is None:
        # Placeholders for pointer arguments the kernels do not read without LoRA.
        dummy = torch.empty((1, 1, 1, 1), dtype=x.dtype, device=x.device)
        return _LoRAArgs(dummy, x, dummy, alignment.sorted_pair_ids, 1, 16, 16, 1, 1, False)
    lora_a, lora_b = (lora.a13, lora.b13) if which == "13" else (lora.a2, lora.b2)
    rp, s_p2 = _lora_meta(lora_a)
    # A fused shrink keeps the whole rank in registers: larger ranks take the separate one.
    fused = gemm.fused_shrink and rp <= MAX_REGISTER_RANK
    # With the shrink fused, x is a placeholder: the GEMM computes x·Aᵀ itself.
    xa = x if fused else lora_shrink_stage(x, lora_a, gather, top_k, alignment, lora, config, gemm)
    nseg = segments_per_pass(config.lora_segments, rp)
    rank, rc = lora_a.shape[2], min(rp, MAX_REGISTER_RANK)
    return _LoRAArgs(lora_a, xa, lora_b, lora.row_slots, rank, rp, rc, s_p2, nseg, fused)


def _on_hopper_kernel(
    gemm: GemmConfig,
    x: torch.Tensor,
    w: torch.Tensor,
    alignment: Alignment,
    w_scale: torch.Tensor | None,
    lora: LoRABuffers | None,
    sizes: tuple[int, int],
) -> bool:
    """Whether this GEMM runs on its Hopper kernel: the configuration asks, the GPU is sm_90
    and the kernels take the operands (``kernels.hopper_gemm.hopper_takes``)."""
    if not (gemm.hopper and on_hopper(x.device)):  # the common case: no more checks
        return False
    rank = padded_rank(lora.a13.shape[2]) if lora is not None else 0
    return hopper_takes(x, w, alignment, w_scale, rank, sizes, gemm.fp8_activations)


def _separate(gemm: GemmConfig) -> GemmConfig:
    """``gemm`` with the LoRA shrink in its own launch (the Hopper kernels read x·Aᵀ from it)."""
    return dataclasses.replace(gemm, fused_shrink=False)


def _hopper_lora(
    la: _LoRAArgs, lora: LoRABuffers | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(xa, B, row slots) for a Hopper kernel, all None without LoRA."""
    if lora is None:
        return None, None, None
    return la.xa, la.b, la.row_slots


def pdl(device: torch.device) -> bool:
    """Whether kernels launch with programmatic dependent launch: Hopper (sm_90) and later
    (the interpreter cannot run its instructions)."""
    return device.type == "cuda" and _capability(device.index) >= (9, 0)


def _pdl_launch(device: torch.device) -> dict[str, bool]:
    """A launch's PDL arguments: the kernel's ``PDL`` constexpr and Triton's ``launch_pdl``."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_available(device: torch.device) -> bool:
    """Whether the device has the tensor copy engine (Hopper, sm_90, and later); Triton's
    CPU interpreter emulates it."""
    if device.type == "cuda":
        return _capability(device.index) >= (9, 0)
    return os.environ.get("TRITON_INTERPRET") == "1"


def weight_descriptor(w: torch.Tensor, gemm: GemmConfig) -> TensorDescriptor | None:
    """A TMA descriptor of expert weights w (E, N, K), or (E, 2, I, K) for W13, for gemm's
    (1, [2,] block_n, block_k) tiles where the configuration asks for one
    (``GemmConfig.tma``) and the copy engine can take it; None means pointer loads (GPUs
    before Hopper, strides not 16-byte aligned)."""
    if not gemm.tma or not tma_available(w.device):
        return None
    aligned = all(stride * w.element_size() % 16 == 0 for stride in w.stride()[:-1])
    if not aligned or w.data_ptr() % 16 or w.stride(-1) != 1:
        return None
    box = [1] * (w.dim() - 2) + [gemm.block_n, gemm.block_k]
    if w.dim() == 4:
        box[1] = 2
    return TensorDescriptor(w, list(w.shape), list(w.stride()), box)


def w13_descriptor(w13: torch.Tensor, gemm: GemmConfig) -> TensorDescriptor | None:
    """``weight_descriptor`` of W13 (E, 2I, H) seen as (E, 2, I, H): one box holds a tile's
    gate rows and its up rows."""
    e, two_i, h = w13.shape
    return weight_descriptor(w13.view(e, 2, two_i // 2, h), gemm)


def _enabled(alignment: Alignment) -> torch.Tensor:
    """The enabled flags pair blocks read, or a placeholder the kernels do not read."""
    return alignment.enabled if alignment.enabled is not None else alignment.block_experts


def _grid(
    alignment: Alignment, num_tiles: int, gemm: GemmConfig, parts: int, device: torch.device
) -> tuple[int]:
    """A program per (block, N program, K part), or with ``gemm.persistent`` that many
    programs per multiprocessor, each looping over the work."""
    work = alignment.max_blocks * triton.cdiv(num_tiles, gemm.tiles_per_program) * parts
    if gemm.persistent:
        return (min(work, gemm.persistent * _multiprocessors(device)),)
    return (work,)


def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors; the interpreter pretends to have 2, so that the tests'
    persistent programs loop."""
    if device.type != "cuda":
        return 2
    return _cuda_multiprocessors(device.index)


@functools.cache
def _cuda_multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _scale_args(
    w: torch.Tensor, scale: torch.Tensor | None, gemm: GemmConfig
) -> tuple[torch.Tensor, int, int, int]:
    """The block-scale arguments of a GEMM launch, (E, N/128, K/128) scales and their three
    strides: those of FP8 weights ``w``, else placeholders the kernel does not read."""
    if scale is None:
        return w, 0, 0, 0
    # A K step must lie in one scale block: the main loop takes one scale per column and step.
    assert FP8_BLOCK % gemm.block_k == 0, f"FP8 weights need BLOCK_K | 128, got {gemm.block_k}"
    return scale, scale.stride(0), scale.stride(1), scale.stride(2)


def w13_stage(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    top_k: int,
    alignment: Alignment,
    lora: LoRABuffers | None,
    config: MoEConfig,
    clear: torch.Tensor | None,
    w13_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """act = activation(x W13ᵀ (+ b13) + LoRA) for every aligned row: (max_rows, I).

    hidden (T, H); w13 (E, 2I, H); b13 (E, 2I) or None. ``clear``: a float32 buffer this
    launch zeroes on the side. ``w13_scale`` (E, ceil(2I/128), ceil(H/128)) float32: w13 is
    FP8 with these block scales.
    """
    h = hidden.shape[1]
    inter = w13.shape[1] // 2
    block_m, max_blocks = alignment.block_m, alignment.max_blocks
    cfg = config.w13
    if _on_hopper_kernel(cfg, hidden, w13, alignment, w13_scale, lora, (inter, h)):
        la = _lora_args(hidden, "13", True, top_k, alignment, lora, config, _separate(cfg))
        if clear is not None:
            clear.zero_()
        return w13_stage_hopper(
            hidden, w13, b13, activation, alpha, limit, top_k, alignment,
            *_hopper_lora(la, lora), w13_scale, cfg.pingpong,
        )  # fmt: skip
    act = torch.empty((max_blocks * block_m, inter), dtype=hidden.dtype, device=hidden.device)
    scale, *scale_strides = _scale_args(w13, w13_scale, cfg)
    x, x_scale = _gemm_input(hidden, w13_scale, cfg)
    la = _lora_args(hidden, "13", True, top_k, alignment, lora, config, cfg)
    bias = b13 if b13 is not None else w13
    grid = _grid(alignment, triton.cdiv(inter, cfg.block_n), cfg, 1, hidden.device)
    clear_numel = 0 if clear is None else clear.numel()
    # Pair blocks take pointer loads: through TMA they stream no faster (decision 0012). So do
    # FP8 weights (their main loop is written for pointer loads).
    tma = not alignment.pair_blocks and w13_scale is None
    w_desc = w13_descriptor(w13, cfg) if tma else None
    clear_per_program = triton.cdiv(triton.cdiv(clear_numel, grid[0]), _CLEAR_BLOCK)
    _w13_kernel[grid](
        x, x_scale, w13, w_desc if w_desc is not None else w13, scale, bias, la.a, la.xa, la.b, act,
        alignment.sorted_pair_ids, la.row_slots, _enabled(alignment), alignment.block_experts,
        clear if clear is not None else act, clear_numel, clear_per_program * _CLEAR_BLOCK,
        max_blocks, h, inter, top_k, la.rank, alpha, limit,
        x.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), bias.stride(0),
        *scale_strides,
        la.a.stride(0), la.a.stride(1), la.a.stride(2),
        la.b.stride(0), la.b.stride(1), la.b.stride(2), la.b.stride(3),
        act.stride(0),
        ACTIVATION=0 if activation is Activation.SILU else 1,
        HAS_BIAS=b13 is not None, HAS_LORA=lora is not None, FUSED_SHRINK=la.fused,
        PAIR_BLOCKS=alignment.pair_blocks,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        TILES_PER_PROGRAM=cfg.tiles_per_program, GROUP_M=cfg.group_m,
        NSEG=la.nseg, RP=la.rp, RC=la.rc, S_P2=la.s_p2,
        EVEN_K=h % cfg.block_k == 0, W_TMA=0 if w_desc is None else 4,
        FP8=_fp8_mode(w13_scale, cfg), PRECISION=_dot_precision(hidden.dtype),
        CLEAR_BLOCK=_CLEAR_BLOCK, PERSISTENT=cfg.persistent > 0,
        **_pdl_launch(hidden.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return act


def _split_k(inter: int, gemm: GemmConfig, atomic_sum: bool) -> tuple[int, int]:
    """(parts, K columns per part) of w2's reduction: ``gemm.split_k`` parts of whole
    BLOCK_K steps where the sum is atomic (the parts add into it), else one."""
    parts = gemm.split_k if atomic_sum else 1
    k_split = triton.cdiv(triton.cdiv(inter, parts), gemm.block_k) * gemm.block_k
    parts = min(parts, triton.cdiv(inter, k_split))  # no part without columns
    return parts, k_split


def w2_stage(
    act: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    alignment: Alignment,
    lora: LoRABuffers | None,
    config: MoEConfig,
    out: torch.Tensor,
    w2_scale: torch.Tensor | None = None,
) -> None:
    """y = w_j · (a W2ᵀ (+ b2) + LoRA) for every pair, into ``out``.

    act (max_rows, I) from ``w13_stage``; w2 (E, H, I); b2 (E, H) or None; topk_weights
    (T, k) float32. With ``config.atomic_sum`` ``out`` is (T, H) float32, zeroed, and
    receives Σ_j y_j; else it is (T*k, H) and row p receives pair p's y. ``w2_scale``
    (E, ceil(H/128), ceil(I/128)) float32: w2 is FP8 with these block scales.
    """
    h, inter = w2.shape[1], w2.shape[2]
    top_k = topk_weights.shape[1]
    cfg = config.w2
    if _on_hopper_kernel(cfg, act, w2, alignment, w2_scale, lora, (h, inter)):
        la = _lora_args(act, "2", False, top_k, alignment, lora, config, _separate(cfg))
        w2_stage_hopper(
            act, w2, b2, topk_weights, alignment, *_hopper_lora(la, lora), config.atomic_sum, out,
            w2_scale, cfg.pingpong,
        )  # fmt: skip
        return
    scale, *scale_strides = _scale_args(w2, w2_scale, cfg)
    x, x_scale = _gemm_input(act, w2_scale, cfg)
    la = _lora_args(act, "2", False, top_k, alignment, lora, config, cfg)
    bias = b2 if b2 is not None else w2
    # Pair blocks take pointer loads: through TMA they stream no faster (decision 0012). So do
    # FP8 weights (their main loop is written for pointer loads).
    tma = not alignment.pair_blocks and w2_scale is None
    w_desc = weight_descriptor(w2, cfg) if tma else None
    split_k, k_split = _split_k(inter, cfg, config.atomic_sum)
    _w2_kernel[_grid(alignment, triton.cdiv(h, cfg.block_n), cfg, split_k, act.device)](
        x, x_scale, w2, w_desc if w_desc is not None else w2, scale, bias, la.a, la.xa, la.b, out,
        alignment.sorted_pair_ids, la.row_slots, _enabled(alignment), alignment.block_experts,
        topk_weights,
        alignment.max_blocks, h, inter, k_split, top_k, la.rank,
        x.stride(0), x_scale.stride(0), w2.stride(0), w2.stride(1), bias.stride(0),
        *scale_strides,
        la.a.stride(0), la.a.stride(1), la.a.stride(2),
        la.b.stride(0), la.b.stride(1), la.b.stride(2), la.b.stride(3),
        out.stride(0),
        HAS_BIAS=b2 is not None, HAS_LORA=lora is not None, FUSED_SHRINK=la.fused,
        ATOMIC_SUM=config.atomic_sum, PAIR_BLOCKS=alignment.pair_blocks, SPLIT_K=split_k,
        BLOCK_M=alignment.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        TILES_PER_PROGRAM=cfg.tiles_per_program, GROUP_M=cfg.group_m,
        NSEG=la.nseg, RP=la.rp, RC=la.rc, S_P2=la.s_p2,
        EVEN_K=inter % cfg.block_k == 0, W_TMA=0 if w_desc is None else 3,
        FP8=_fp8_mode(w2_scale, cfg), PRECISION=_dot_precision(act.dtype),
        PERSISTENT=cfg.persistent > 0,
        **_pdl_launch(act.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def sum_over_k(
    y: torch.Tensor, top_k: int, addend: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """(T*k, H) pair rows → (T, H) Σ_j (+ addend), summed in float32, rounded once to
    ``dtype``. With k = 1 it is the final cast of the atomic sum (a Triton launch, so that it
    too starts early under PDL)."""
    rows, h = y.shape
    out = torch.empty((rows // top_k, h), dtype=dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_k_kernel[(rows // top_k, triton.cdiv(h, block_h))](
        y, addend if addend is not None else y, out, h,
        TOP_K=top_k, HAS_ADDEND=addend is not None, BLOCK_H=block_h,
        **_pdl_launch(y.device),
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
    lora: LoRABuffers | None,
    config: MoEConfig,
    addend: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_j w_j · expert_j(x) (+ LoRA) (+ addend) for every token: (T, H) in hidden's dtype.

    hidden (T, H); w13 (E, 2I, H); w2 (E, H, I); b13 (E, 2I) / b2 (E, H) or None;
    topk_weights (T, k) float32; addend (T, H) (the shared expert's output) is added before
    the one final rounding. All operands share hidden's dtype and have a contiguous last
    dimension, but for FP8 experts: w13 and w2 float8_e4m3fn with their float32 block scales
    ``w13_scale`` (E, ceil(2I/128), ceil(H/128)) and ``w2_scale`` (E, ceil(H/128),
    ceil(I/128)); the configuration's block_k must then divide 128.
    """
    t, h = hidden.shape
    top_k = topk_weights.shape[1]
    args = (hidden, w13, b13, activation, alpha, limit, top_k, alignment, lora, config)
    if config.atomic_sum:
        acc = torch.empty((t, h), dtype=torch.float32, device=hidden.device)
        act = w13_stage(*args, clear=acc, w13_scale=w13_scale)
        w2_stage(act, w2, b2, topk_weights, alignment, lora, config, acc, w2_scale)
        return sum_over_k(acc, 1, addend, hidden.dtype)
    act = w13_stage(*args, clear=None, w13_scale=w13_scale)
    y = torch.empty((t * top_k, h), dtype=hidden.dtype, device=hidden.device)
    w2_stage(act, w2, b2, topk_weights, alignment, lora, config, y, w2_scale)
    return sum_over_k(y, top_k, addend, hidden.dtype)
