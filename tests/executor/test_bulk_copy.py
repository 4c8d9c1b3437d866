"""A load's bulk copies cut into pieces: the pieces cover the tensors exactly once, each within
the byte limit, whatever the strides (a slot's rank columns are a strided view); on a GPU the
copy in pieces moves the bytes exactly, host→device and back."""

from __future__ import annotations

import pytest
import torch

from executor_service import bulk_copy
from executor_service.bulk_copy import chunks, copy_in_pieces


@pytest.mark.parametrize(
    ("shape", "limit"),
    [
        ((6, 5, 7), 5 * 7 * 2 * 2),  # two rows a piece
        ((6, 5, 7), 5 * 7 * 2 * 2 + 3),  # a limit that is not a whole number of rows
        ((3, 5, 7), 7 * 2 * 3),  # a row larger than the limit: cut along the next dimension
        ((3, 5, 7), 1),  # smaller than an element: one element a piece
        ((4, 2), 10**6),  # all at once
        ((0, 3), 8),  # empty
    ],
)
def test_pieces_cover_a_strided_copy_exactly_once(shape: tuple[int, ...], limit: int) -> None:
    slot = torch.zeros(*shape[:-1], shape[-1] + 4, dtype=torch.int16)  # rank columns + spare
    dest = slot[..., : shape[-1]]
    source = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.int16).reshape(shape)
    for piece_dest, piece_source in chunks(dest, source, limit):
        assert piece_dest.shape == piece_source.shape
        assert piece_dest.numel() * piece_dest.element_size() <= max(limit, 2)
        piece_dest += piece_source  # an element covered twice would hold twice its value
    assert torch.equal(dest, source)
    assert int(slot[..., shape[-1] :].count_nonzero()) == 0, "nothing written past the view"


def test_a_copy_between_different_shapes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"copy of shape \(2, 3\) into \(3, 2\)"):
        list(chunks(torch.zeros(3, 2), torch.zeros(2, 3), 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_in_pieces_move_the_bytes_exactly_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bulk_copy, "PIECE_BYTES", 1 << 20)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    experts, rank, hidden = 40, 96, ((1 << 20) // 96) + 5  # rows just over a piece
    source = torch.randn(experts, rank, hidden).to(torch.bfloat16).pin_memory()
    slot = torch.zeros(experts, rank + 32, hidden, dtype=torch.bfloat16, device="cuda")
    back = torch.empty_like(source).pin_memory()
    with torch.cuda.stream(stream):
        copy_in_pieces(slot[:, :rank], source)
        copy_in_pieces(back, slot[:, :rank])
    stream.synchronize()
    assert torch.equal(back, source)
    assert int(slot[:, rank:].count_nonzero()) == 0
