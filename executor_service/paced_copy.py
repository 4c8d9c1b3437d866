"""Where a load's bulk host↔device copies are fed to the GPU's copy engines a chunk at a time,
so that serving's small copies are not stuck behind them.

A copy engine kept busy back to back by one stream starves the copies of every other stream.
Measured on an H100 (``Forward``-like step: a 64 KB pinned input copy, 8 small matmuls, a
64 KB output copy; a 630 MB bulk copy on another stream beside it):

* the step went from 134 µs to 12 ms, whether the 630 MB went as one copy or as 8 MiB pieces
  enqueued together: the engine takes a stream's queued copies before anyone else's;
* with two 4 MiB pieces queued at a time it was still 0.7–12 ms; with one piece in flight at a
  time (the next enqueued once the last finished) 174–181 µs, the bulk copy moving 30–33 GB/s
  (1 MiB: 17 GB/s; 16 MiB: 373 µs).

So a load copies ``CHUNK_BYTES`` at a time, one chunk in flight: the moment between two chunks
is where serving's copies go. The waiting thread sleeps (blocking-sync events), not spins.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: Bytes of one chunk: the longest a serving copy waits behind a load (4 MiB at ~50 GB/s is
#: about 80 µs), and few enough chunks that the gaps between them cost a third of the rate.
CHUNK_BYTES = 4 << 20


def chunks(
    dest: torch.Tensor, source: torch.Tensor, limit: int = CHUNK_BYTES
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


class PacedCopier:
    """Copies on ``stream`` with one chunk in flight at a time (see the module doc). The
    calling thread waits for each chunk before the next: use it from a thread that may block,
    as loads and slot writes do."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._last: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Returns once the last chunk enqueued has been copied."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None

    def enqueued(self) -> None:
        """Marks the end of work just enqueued on the stream (a chunk's copy): the next
        ``wait`` returns after it."""
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(self.stream)
        self._last = event

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        """dest ← source (one on the host, page-locked, the other on the device), enqueued on
        the stream after what is already there, chunk by chunk."""
        with torch.cuda.stream(self.stream):
            for piece_dest, piece_source in chunks(dest, source):
                self.wait()
                piece_dest.copy_(piece_source, non_blocking=True)
                self.enqueued()
