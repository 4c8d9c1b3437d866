"""The alignment's layout invariants, for the single-program and the multi-program paths."""

from __future__ import annotations

import pytest
import torch

from kernels import align
from kernels.synthetic import random_token_slots

from .conftest import DEVICE


def _check_layout(
    al: align.Alignment,
    topk_ids: torch.Tensor,
    num_experts: int,
    effective_slots: torch.Tensor | None,
) -> None:
    bm = al.block_m
    top_k = topk_ids.shape[1]
    experts = al.block_experts.cpu()
    used = int((experts >= 0).sum())
    assert (experts[:used] >= 0).all() and (experts[used:] == -1).all()
    assert (experts[:used][1:] >= experts[:used][:-1]).all(), "blocks sorted by expert"
    rows = al.sorted_pair_ids[: used * bm].cpu()
    real = rows >= 0
    assert sorted(rows[real].tolist()) == list(range(topk_ids.numel())), "each pair once"
    row_expert = experts.repeat_interleave(bm)[: used * bm]
    flat_ids = topk_ids.flatten().cpu().long()
    assert torch.equal(flat_ids[rows[real].long()], row_expert[real].long()), "block's expert"
    for e in range(num_experts):
        n = int((flat_ids == e).sum())
        assert int((row_expert == e).sum()) == -(-n // bm) * bm, "padding below BLOCK_M"
    if effective_slots is None:
        assert al.row_slots is None
        return
    assert al.row_slots is not None
    row_slots = al.row_slots[: used * bm].cpu()
    assert (row_slots[~real] == -1).all()
    assert torch.equal(row_slots[real], effective_slots[rows[real].long() // top_k])
    if al.sorted_by_slot:
        # Within each expert: slots ascending, rows without an adapter after them, then padding.
        big = 1 << 20
        key = torch.where(row_slots >= 0, row_slots, big) + torch.where(real, 0, 2 * big)
        for e in range(num_experts):
            keys = key[row_expert == e]
            assert (keys[1:] >= keys[:-1]).all(), f"expert {e}'s rows not sorted by slot"


def _segments_per_block(al: align.Alignment) -> list[int]:
    assert al.row_slots is not None
    used = int((al.block_experts >= 0).sum())
    blocks = al.row_slots[: used * al.block_m].cpu().view(used, al.block_m)
    return [len({s for s in block.tolist() if s >= 0}) for block in blocks]


@pytest.mark.parametrize("single_program", [True, False])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m", "with_lora"),
    [
        (1, 1, 5, 16, True),
        (7, 2, 6, 16, True),
        (37, 4, 13, 16, False),
        (64, 8, 128, 16, True),
        (300, 2, 3, 32, True),
        (50, 4, 4, 64, False),
    ],
)
def test_alignment_layout(
    monkeypatch: pytest.MonkeyPatch,
    single_program: bool,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    block_m: int,
    with_lora: bool,
) -> None:
    monkeypatch.setattr(align, "SINGLE_PROGRAM_MAX_PAIRS", 1 << 30 if single_program else 0)
    g = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.stack(
        [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
    ).to(torch.int32)
    num_slots = 5
    token_slots = random_token_slots(num_tokens, num_slots, seed=num_tokens)
    enabled = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    effective = None
    if with_lora:
        on = enabled[token_slots.clamp(min=0).long()] != 0
        effective = torch.where((token_slots >= 0) & on, token_slots, -1)
    al = align.align_pairs(
        topk_ids.to(DEVICE),
        num_experts,
        block_m,
        token_slots=token_slots.to(DEVICE) if with_lora else None,
        enabled=enabled.to(DEVICE) if with_lora else None,
    )
    _check_layout(al, topk_ids, num_experts, effective)


def test_all_pairs_on_one_expert_fit_the_bound() -> None:
    topk_ids = torch.full((33, 1), 2, dtype=torch.int32)
    al = align.align_pairs(topk_ids.to(DEVICE), 3, 16)
    assert al.max_blocks == align.max_padded_rows(33, 3, 16) // 16
    _check_layout(al, topk_ids, 3, None)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("single_program", [True, False])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [(1, 1, 5, 16), (150, 2, 3, 16), (64, 8, 128, 16), (90, 4, 7, 32)],
)
def test_alignment_sorted_by_slot(
    monkeypatch: pytest.MonkeyPatch,
    single_program: bool,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    block_m: int,
) -> None:
    """sort_slots: the same layout, each expert's rows ordered by slot (tokens without an
    adapter and those of the disabled slot 2 last), from poisoned buffers."""
    monkeypatch.setattr(align, "SINGLE_PROGRAM_MAX_PAIRS", 1 << 30 if single_program else 0)
    g = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.stack(
        [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
    ).to(torch.int32)
    token_slots = random_token_slots(num_tokens, 5, seed=num_tokens)
    enabled = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    on = enabled[token_slots.clamp(min=0).long()] != 0
    effective = torch.where((token_slots >= 0) & on, token_slots, -1)
    args = (topk_ids.to(DEVICE), num_experts, block_m, token_slots.to(DEVICE), enabled.to(DEVICE))
    al = align.align_pairs(*args, sort_slots=True)
    assert al.sorted_by_slot
    _check_layout(al, topk_ids, num_experts, effective)
    unsorted = align.align_pairs(*args)
    assert torch.equal(al.block_experts.cpu(), unsorted.block_experts.cpu()), "same padding"
    assert sum(_segments_per_block(al)) <= sum(_segments_per_block(unsorted))


def test_sorted_blocks_hold_the_slots_they_cross() -> None:
    """4 adapters round-robin over one expert's 64 rows: 16 rows each, so 16-row blocks
    hold one adapter each once sorted (all 4 unsorted); 3 adapters (runs of 22, 21, 21 rows)
    give the blocks that span a slot boundary 2 segments."""
    topk_ids = torch.zeros((64, 1), dtype=torch.int32)
    enabled = torch.ones(4, dtype=torch.int32)
    slots = torch.arange(64, dtype=torch.int32) % 4
    al = align.align_pairs(topk_ids.to(DEVICE), 2, 16, slots.to(DEVICE), enabled.to(DEVICE), True)
    assert _segments_per_block(al) == [1, 1, 1, 1]
    al = align.align_pairs(topk_ids.to(DEVICE), 2, 16, slots.to(DEVICE), enabled.to(DEVICE))
    assert _segments_per_block(al) == [4, 4, 4, 4]
    slots = torch.arange(64, dtype=torch.int32) % 3
    al = align.align_pairs(topk_ids.to(DEVICE), 2, 16, slots.to(DEVICE), enabled.to(DEVICE), True)
    assert _segments_per_block(al) == [1, 2, 2, 1]
