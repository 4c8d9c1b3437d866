"""Token/expert alignment: group the (token, expert) pairs into BLOCK_M-row blocks, LoRA-aware.

Pair ``p = t * k + j`` is token t's j-th routed expert. The pairs are laid out in rows sorted
by expert, and within an expert by adapter slot (pairs without an adapter first); each expert's
rows are padded to a multiple of BLOCK_M, so every block belongs to one expert. Blocks are *not*
split by slot: a block may hold a few slots, one after the other ("segments"), and the GEMM
kernels give each segment its adapter. That keeps the padding (wasted MMA rows) that of the base
MoE, where per-(expert, slot) blocks would pad every (expert, slot) group.

Outputs (``Alignment``):
    sorted_pair_ids (max_rows,)   int32: the pair in each row, -1 for padding rows
    row_slots       (max_rows,)   int32: the pair's effective slot, -1 for none/padding
                                   (None without LoRA)
    block_experts   (max_blocks,) int32: each block's expert, -1 past the last used block

The sizes are upper bounds known on the host (so no GPU→host synchronisation and the whole
forward can be captured in a CUDA graph); rows of unused blocks are left unwritten and never
read. The order of pairs that share (expert, slot) is decided by atomics and may vary between
runs; it does not change any result, since every row is computed independently.

Two implementations of the same layout: one program for small batches (one launch), and
count / layout / scatter launches across the GPU for large ones.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Up to this many pairs a single program aligns everything (one launch, no memset).
SINGLE_PROGRAM_MAX_PAIRS = 4096
_BLOCK_P = 1024  # pairs per program step
_BLOCK_B = 64  # blocks per step when writing block_experts


@dataclass(frozen=True)
class Alignment:
    sorted_pair_ids: torch.Tensor
    row_slots: torch.Tensor | None
    block_experts: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return int(self.block_experts.numel())


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows needed in the worst case: every expert that gets a pair pads up to BLOCK_M - 1."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit
def _pair_keys(
    topk_ids_ptr,
    token_slots_ptr,
    enabled_ptr,
    offs,
    num_pairs,
    top_k,
    SLOT_STRIDE: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    """Sort key ``expert * SLOT_STRIDE + slot + 1`` of the pairs ``offs``, their slot, a mask."""
    mask = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
    if HAS_LORA:
        slot = tl.load(token_slots_ptr + offs // top_k, mask=mask, other=-1)
        enabled = tl.load(enabled_ptr + tl.maximum(slot, 0), mask=mask & (slot >= 0), other=0)
        slot = tl.where(enabled != 0, slot, -1)
    else:
        slot = tl.full(offs.shape, -1, tl.int32)
    return expert * SLOT_STRIDE + slot + 1, slot, mask


@triton.jit
def _write_layout(
    counts,
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    max_blocks,
    E_P2: tl.constexpr,
    SLOT_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    """From the per-key counts: each key's first row (into the cursors), the padding rows'
    sentinels, and every block's expert."""
    counts = tl.reshape(counts, (E_P2, SLOT_STRIDE))
    expert_counts = tl.sum(counts, axis=1)
    padded = tl.cdiv(expert_counts, BLOCK_M) * BLOCK_M
    expert_end = tl.cumsum(padded, 0)
    expert_start = expert_end - padded
    key_start = expert_start[:, None] + tl.cumsum(counts, 1) - counts
    keys = tl.arange(0, E_P2)[:, None] * SLOT_STRIDE + tl.arange(0, SLOT_STRIDE)[None, :]
    tl.store(cursor_ptr + keys, key_start)

    pad_rows = (expert_start + expert_counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad_mask = pad_rows < expert_end[:, None]
    tl.store(pair_ids_ptr + pad_rows, -1, mask=pad_mask)
    if HAS_LORA:
        tl.store(row_slots_ptr + pad_rows, -1, mask=pad_mask)

    # Block b starts at row b * BLOCK_M; its expert is the number of experts ending at or before.
    total_rows = tl.sum(padded, axis=0)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_row = blocks * BLOCK_M
        expert = tl.sum((expert_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < total_rows, expert, -1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < max_blocks)


@triton.jit
def _scatter_pairs(
    key, slot, mask, offs, cursor_ptr, pair_ids_ptr, row_slots_ptr, HAS_LORA: tl.constexpr
):
    """Each pair takes the next free row of its key."""
    row = tl.atomic_add(cursor_ptr + key, 1, mask=mask)
    tl.store(pair_ids_ptr + row, offs, mask=mask)
    if HAS_LORA:
        tl.store(row_slots_ptr + row, slot, mask=mask)


@triton.jit
def _align_single_program_kernel(
    topk_ids_ptr,
    token_slots_ptr,
    enabled_ptr,
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    num_pairs,
    top_k,
    max_blocks,
    E_P2: tl.constexpr,
    SLOT_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    NUM_KEYS: tl.constexpr = E_P2 * SLOT_STRIDE
    counts = tl.zeros([NUM_KEYS], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        key, slot, mask = _pair_keys(
            topk_ids_ptr, token_slots_ptr, enabled_ptr, offs, num_pairs, top_k,
            SLOT_STRIDE, HAS_LORA,
        )  # fmt: skip
        counts += tl.histogram(key, NUM_KEYS, mask=mask)
    _write_layout(
        counts, cursor_ptr, pair_ids_ptr, row_slots_ptr, block_experts_ptr, max_blocks,
        E_P2, SLOT_STRIDE, BLOCK_M, BLOCK_B, HAS_LORA,
    )  # fmt: skip
    tl.debug_barrier()  # the cursors just stored are incremented by other threads below
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        key, slot, mask = _pair_keys(
            topk_ids_ptr, token_slots_ptr, enabled_ptr, offs, num_pairs, top_k,
            SLOT_STRIDE, HAS_LORA,
        )  # fmt: skip
        _scatter_pairs(key, slot, mask, offs, cursor_ptr, pair_ids_ptr, row_slots_ptr, HAS_LORA)


@triton.jit
def _count_kernel(
    topk_ids_ptr,
    token_slots_ptr,
    enabled_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    NUM_KEYS: tl.constexpr,
    SLOT_STRIDE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    key, _, mask = _pair_keys(
        topk_ids_ptr, token_slots_ptr, enabled_ptr, offs, num_pairs, top_k, SLOT_STRIDE, HAS_LORA
    )
    counts = tl.histogram(key, NUM_KEYS, mask=mask)
    tl.atomic_add(counts_ptr + tl.arange(0, NUM_KEYS), counts, mask=counts > 0)


@triton.jit
def _layout_kernel(
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    max_blocks,
    E_P2: tl.constexpr,
    SLOT_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    # The cursors hold the counts on entry and each key's first row on exit.
    counts = tl.load(cursor_ptr + tl.arange(0, E_P2 * SLOT_STRIDE))
    _write_layout(
        counts, cursor_ptr, pair_ids_ptr, row_slots_ptr, block_experts_ptr, max_blocks,
        E_P2, SLOT_STRIDE, BLOCK_M, BLOCK_B, HAS_LORA,
    )  # fmt: skip


@triton.jit
def _scatter_kernel(
    topk_ids_ptr,
    token_slots_ptr,
    enabled_ptr,
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    num_pairs,
    top_k,
    SLOT_STRIDE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    key, slot, mask = _pair_keys(
        topk_ids_ptr, token_slots_ptr, enabled_ptr, offs, num_pairs, top_k, SLOT_STRIDE, HAS_LORA
    )
    _scatter_pairs(key, slot, mask, offs, cursor_ptr, pair_ids_ptr, row_slots_ptr, HAS_LORA)


def align_pairs(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    token_slots: torch.Tensor | None = None,
    enabled: torch.Tensor | None = None,
) -> Alignment:
    """Lay out the pairs of ``topk_ids`` (T, k) int32 in expert-homogeneous BLOCK_M blocks.

    With ``token_slots`` (T,) int32 and ``enabled`` (S,) int32, rows within an expert are sorted
    by effective slot (-1 = no adapter, or a disabled slot) and ``row_slots`` is returned.
    """
    has_lora = token_slots is not None
    if has_lora and enabled is None:
        raise ValueError("align_pairs needs the slots' enabled flags with token_slots")
    num_pairs = topk_ids.numel()
    top_k = topk_ids.shape[1]
    device = topk_ids.device
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    max_blocks = max_rows // block_m
    pair_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    row_slots = torch.empty(max_rows, dtype=torch.int32, device=device) if has_lora else None
    if max_blocks == 0:
        return Alignment(pair_ids, row_slots, block_experts, block_m)

    e_p2 = triton.next_power_of_2(num_experts)
    slot_stride = 1
    if enabled is not None and token_slots is not None:
        slot_stride = triton.next_power_of_2(enabled.numel() + 1)
    num_keys = e_p2 * slot_stride
    # Unused pointer arguments get a valid tensor; the kernels never read them.
    slots_arg = token_slots if token_slots is not None else topk_ids
    enabled_arg = enabled if enabled is not None else topk_ids
    row_slots_arg = row_slots if row_slots is not None else pair_ids
    common = {"SLOT_STRIDE": slot_stride, "HAS_LORA": has_lora}
    if num_pairs <= SINGLE_PROGRAM_MAX_PAIRS:
        cursor = torch.empty(num_keys, dtype=torch.int32, device=device)
        _align_single_program_kernel[(1,)](
            topk_ids, slots_arg, enabled_arg, cursor, pair_ids, row_slots_arg, block_experts,
            num_pairs, top_k, max_blocks,
            E_P2=e_p2, BLOCK_M=block_m, BLOCK_P=_BLOCK_P, BLOCK_B=_BLOCK_B, **common,
            num_warps=8,
        )  # fmt: skip
    else:
        cursor = torch.zeros(num_keys, dtype=torch.int32, device=device)
        grid = (triton.cdiv(num_pairs, _BLOCK_P),)
        _count_kernel[grid](
            topk_ids, slots_arg, enabled_arg, cursor, num_pairs, top_k,
            NUM_KEYS=num_keys, BLOCK_P=_BLOCK_P, **common,
        )  # fmt: skip
        _layout_kernel[(1,)](
            cursor, pair_ids, row_slots_arg, block_experts, max_blocks,
            E_P2=e_p2, BLOCK_M=block_m, BLOCK_B=_BLOCK_B, **common, num_warps=8,
        )  # fmt: skip
        _scatter_kernel[grid](
            topk_ids, slots_arg, enabled_arg, cursor, pair_ids, row_slots_arg,
            num_pairs, top_k, BLOCK_P=_BLOCK_P, **common,
        )  # fmt: skip
    return Alignment(pair_ids, row_slots, block_experts, block_m)
