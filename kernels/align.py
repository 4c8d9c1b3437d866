"""Token/expert alignment: group the (token, expert) pairs into BLOCK_M-row blocks, LoRA-aware.

Pair ``p = t * k + j`` is token t's j-th routed expert. The pairs are laid out in rows grouped
by expert, each expert's rows padded to a multiple of BLOCK_M, so every block belongs to one
expert. Blocks are *not* split by adapter slot: a block may hold rows of a few slots
("segments"), and the LoRA kernels give each segment its adapter. That keeps the padding
(wasted MMA rows) that of the base MoE, where per-(expert, slot) blocks would pad every
(expert, slot) group, and keeps the sort key space small (E keys, not E·S).

Outputs (``Alignment``):
    sorted_pair_ids (max_rows,)   int32: the pair in each row, -1 for padding rows
    row_slots       (max_rows,)   int32: the pair's effective slot, -1 for none (no adapter,
                                   disabled slot) and padding; None without LoRA
    block_experts   (max_blocks,) int32: each block's expert, -1 past the last used block

The sizes are upper bounds known on the host (so no GPU→host synchronisation and the whole
forward can be captured in a CUDA graph); rows of unused blocks are left unwritten and never
read. The order of the pairs within an expert is decided by atomics and may vary between runs;
it does not change any result, since every row is computed independently.

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
SINGLE_PROGRAM_MAX_PAIRS = 2048
_BLOCK_P = 1024  # pairs per program step
_BLOCK_B = 64  # blocks per step when writing block_experts


@dataclass(frozen=True)
class Alignment:
    """The layout the GEMMs run over (see the module doc). With ``pair_blocks`` nothing was
    launched: block b is pair b alone, in its first row (``block_m`` 16), ``block_experts`` is
    topk_ids itself, ``row_slots`` holds the *token* slots and ``enabled`` the slots' flags,
    which the kernels combine per pair; ``sorted_pair_ids`` is unused."""

    sorted_pair_ids: torch.Tensor
    row_slots: torch.Tensor | None
    block_experts: torch.Tensor
    block_m: int
    enabled: torch.Tensor | None = None
    pair_blocks: bool = False

    @property
    def max_blocks(self) -> int:
        return int(self.block_experts.numel())


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows needed in the worst case: every expert that gets a pair pads up to BLOCK_M - 1."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit
def _pair_experts(topk_ids_ptr, offs, num_pairs):
    """Expert of the pairs ``offs`` and which of them exist."""
    mask = offs < num_pairs
    return tl.load(topk_ids_ptr + offs, mask=mask, other=0), mask


@triton.jit
def pair_slots(token_slots_ptr, enabled_ptr, offs, mask, top_k):
    """Effective adapter slot of the pairs ``offs``: -1 without one or if it is disabled."""
    slot = tl.load(token_slots_ptr + offs // top_k, mask=mask, other=-1)
    enabled = tl.load(enabled_ptr + tl.maximum(slot, 0), mask=mask & (slot >= 0), other=0)
    return tl.where(enabled != 0, slot, -1)


@triton.jit
def _write_layout(
    counts,
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    max_blocks,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    """From the per-expert counts: each expert's first row (into the cursors), the padding
    rows' sentinels, and every block's expert."""
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    expert_end = tl.cumsum(padded, 0)
    expert_start = expert_end - padded
    tl.store(cursor_ptr + tl.arange(0, E_P2), expert_start)

    pad_rows = (expert_start + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
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
    topk_ids_ptr,
    token_slots_ptr,
    enabled_ptr,
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    offs,
    num_pairs,
    top_k,
    HAS_LORA: tl.constexpr,
):
    """Each pair of ``offs`` takes the next free row of its expert."""
    expert, mask = _pair_experts(topk_ids_ptr, offs, num_pairs)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=mask, sem="relaxed")
    tl.store(pair_ids_ptr + row, offs, mask=mask)
    if HAS_LORA:
        slot = pair_slots(token_slots_ptr, enabled_ptr, offs, mask, top_k)
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
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        expert, mask = _pair_experts(topk_ids_ptr, p0 + tl.arange(0, BLOCK_P), num_pairs)
        counts += tl.histogram(expert, E_P2, mask=mask)
    _write_layout(
        counts, cursor_ptr, pair_ids_ptr, row_slots_ptr, block_experts_ptr, max_blocks,
        E_P2, BLOCK_M, BLOCK_B, HAS_LORA,
    )  # fmt: skip
    tl.debug_barrier()  # the cursors just stored are incremented by other threads below
    for p0 in range(0, num_pairs, BLOCK_P):
        _scatter_pairs(
            topk_ids_ptr, token_slots_ptr, enabled_ptr, cursor_ptr, pair_ids_ptr,
            row_slots_ptr, p0 + tl.arange(0, BLOCK_P), num_pairs, top_k, HAS_LORA,
        )  # fmt: skip


@triton.jit
def _count_kernel(topk_ids_ptr, counts_ptr, num_pairs, E_P2: tl.constexpr, BLOCK_P: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    expert, mask = _pair_experts(topk_ids_ptr, offs, num_pairs)
    counts = tl.histogram(expert, E_P2, mask=mask)
    tl.atomic_add(counts_ptr + tl.arange(0, E_P2), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _layout_kernel(
    cursor_ptr,
    pair_ids_ptr,
    row_slots_ptr,
    block_experts_ptr,
    max_blocks,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    # The cursors hold the counts on entry and each expert's first row on exit.
    counts = tl.load(cursor_ptr + tl.arange(0, E_P2))
    _write_layout(
        counts, cursor_ptr, pair_ids_ptr, row_slots_ptr, block_experts_ptr, max_blocks,
        E_P2, BLOCK_M, BLOCK_B, HAS_LORA,
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
    BLOCK_P: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    _scatter_pairs(
        topk_ids_ptr, token_slots_ptr, enabled_ptr, cursor_ptr, pair_ids_ptr, row_slots_ptr,
        tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P), num_pairs, top_k, HAS_LORA,
    )  # fmt: skip


#: Rows of a pair block: the smallest tile tl.dot takes.
PAIR_BLOCK_M = 16


def pair_blocks(
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor | None = None,
    enabled: torch.Tensor | None = None,
) -> Alignment:
    """The alignment folded into the GEMMs, for a handful of pairs: no launch, one 16-row
    block per pair (weights are streamed once per pair anyway when pairs rarely share an
    expert), so a decode step pays no alignment launch and no sort."""
    if token_slots is not None and enabled is None:
        raise ValueError("pair_blocks needs the slots' enabled flags with token_slots")
    ids = topk_ids.reshape(-1)
    return Alignment(ids, token_slots, ids, PAIR_BLOCK_M, enabled, pair_blocks=True)


def align_pairs(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    token_slots: torch.Tensor | None = None,
    enabled: torch.Tensor | None = None,
) -> Alignment:
    """Lay out the pairs of ``topk_ids`` (T, k) int32 in expert-homogeneous BLOCK_M blocks.

    With ``token_slots`` (T,) int32 and ``enabled`` (S,) int32, ``row_slots`` gives each row's
    effective slot (-1 = no adapter, or a disabled slot).
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
    # Unused pointer arguments get a valid tensor; the kernels never read them.
    slots_arg = token_slots if token_slots is not None else topk_ids
    enabled_arg = enabled if enabled is not None else topk_ids
    row_slots_arg = row_slots if row_slots is not None else pair_ids
    if num_pairs <= SINGLE_PROGRAM_MAX_PAIRS:
        cursor = torch.empty(e_p2, dtype=torch.int32, device=device)
        _align_single_program_kernel[(1,)](
            topk_ids, slots_arg, enabled_arg, cursor, pair_ids, row_slots_arg, block_experts,
            num_pairs, top_k, max_blocks,
            E_P2=e_p2, BLOCK_M=block_m, BLOCK_P=_BLOCK_P, BLOCK_B=_BLOCK_B, HAS_LORA=has_lora,
            num_warps=8,
        )  # fmt: skip
    else:
        cursor = torch.zeros(e_p2, dtype=torch.int32, device=device)
        grid = (triton.cdiv(num_pairs, _BLOCK_P),)
        _count_kernel[grid](topk_ids, cursor, num_pairs, E_P2=e_p2, BLOCK_P=_BLOCK_P)
        _layout_kernel[(1,)](
            cursor, pair_ids, row_slots_arg, block_experts, max_blocks,
            E_P2=e_p2, BLOCK_M=block_m, BLOCK_B=_BLOCK_B, HAS_LORA=has_lora, num_warps=8,
        )  # fmt: skip
        _scatter_kernel[grid](
            topk_ids, slots_arg, enabled_arg, cursor, pair_ids, row_slots_arg,
            num_pairs, top_k, BLOCK_P=_BLOCK_P, HAS_LORA=has_lora,
        )  # fmt: skip
    return Alignment(pair_ids, row_slots, block_experts, block_m)
