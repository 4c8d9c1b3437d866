"""Where a load's bulk host↔device copies are issued: in pieces of at most ``PIECE_BYTES``, all
enqueued at once on the load's stream.

A copy into a strided device view (a slot's first ``rank`` columns, when the adapter's rank is
below the slots' maximum) goes through a contiguous device temporary as large as the copy:
the pieces bound it. Nothing else holds a load's copies back. Forward's own input and output
do not go through the copy engines (``kernels/host_copy.py``), so a load may keep them busy
back to back. Before that, a copy engine served one stream's queued copies before anyone
else's: a Forward step waited 12 ms behind a 630 MB copy, so each piece of a load waited for
the last one, which cost a third of the load's copy rate and a Python wake-up per 4 MiB.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: Bytes of one piece: the largest device temporary a strided copy needs.
PIECE_BYTES = 64 << 20


def chunks(
    dest: torch.Tensor, source: torch.Tensor, limit: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(dest, source) pieces of at most ``limit`` bytes each that together cover the tensors
    (same shape, any strides): runs of whole rows of the leading dimension, a row that is
    larger cut along the next dimension. A 0-d tensor is one piece."""
    if dest.shape != source.shape:
        raise ValueError(f"copy of shape {tuple(source.shape)} into {tuple(dest.shape)}")
    if dest.dim() == 0 or dest.numel() * dest.element_size() <= limit:
        yield dest, source
        return
    row = dest[0].numel() * dest.element_size()
    if row > limit and dest.dim() > 1:
        for index in range(dest.shape[0]):
            yield from chunks(dest[index], source[index], limit)
        return
    rows = max(1, limit // max(row, 1))
    for start in range(0, dest.shape[0], rows):
        yield dest[start : start + rows], source[start : start + rows]


def copy_in_pieces(dest: torch.Tensor, source: torch.Tensor) -> None:
    """dest ← source (one on the host, page-locked, the other on the device), enqueued on the
    current stream piece by piece, without waiting."""
    for piece_dest, piece_source in chunks(dest, source, PIECE_BYTES):
        piece_dest.copy_(piece_source, non_blocking=True)
