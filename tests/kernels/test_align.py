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
