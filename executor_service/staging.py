"""Page-locked host buffers for one launch's input, slot ids, routing and output.

Request bytes are copied once, straight from the message into the page-locked input (casting
to the compute dtype on the way when the wire dtype differs). The GPU's threads then read them
there, and write the output back there (``kernels/host_copy.py``): no copy engine is involved,
so Forward never waits behind a load's bulk copies. A launch needs one synchronisation, at its
end. A ``Staging`` belongs to the one thread that launches work on the device (the
scheduler's), and its buffers are reused launch after launch. ``growable`` ones are replaced by
larger ones when a longer launch comes. A CUDA graph's are fixed: the graph reads and writes
them in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import Routing
from kernels.host_copy import row_addresses


class Staging:
    """Reusable page-locked buffers of ``hidden_size`` columns in ``dtype``, for ``rows`` rows
    (more later if ``growable``)."""

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, rows: int, *, growable: bool = True
    ) -> None:
        self._hidden = hidden_size
        self._dtype = dtype
        self._growable = growable
        self.input = self.output = self.slots = torch.empty(0)
        #: Per row, the address it is gathered from and the one it is scattered to (0: none):
        #: a device-I/O graph's way in and out (``kernels.host_copy.gather_rows``).
        self.sources = self.dests = torch.empty(0, dtype=torch.int64)
        self._grow(rows)
        self._topk_ids = torch.empty(0, dtype=torch.int32)
        self._topk_weights = torch.empty(0, dtype=torch.float32)

    def _grow(self, rows: int) -> None:
        held = self.input.shape[0]
        if rows <= held:
            return
        if held and not self._growable:
            raise ValueError(f"{rows} rows do not fit fixed staging of {held}")
        # Zeros, not garbage: a graph computes its padding rows too, from whatever is here.
        self.input = torch.zeros(rows, self._hidden, dtype=self._dtype).pin_memory()
        self.output = torch.empty(rows, self._hidden, dtype=self._dtype).pin_memory()
        self.slots = torch.empty(rows, dtype=torch.int32).pin_memory()
        self.sources = torch.zeros(rows, dtype=torch.int64).pin_memory()
        self.dests = torch.zeros(rows, dtype=torch.int64).pin_memory()

    def fill(
        self,
        parts: Sequence[torch.Tensor],
        token_slots: torch.Tensor | None,
        pad_to: int = 0,
    ) -> int:
        """Copies the requests' rows (and slot ids) one after the other; rows from there up to
        ``pad_to`` get slot -1 (no adapter). Returns the rows."""
        rows = sum(int(p.shape[0]) for p in parts)
        self._grow(max(rows, pad_to))
        # One torch call for all parts: each call may give up the GIL, and the launch loop may
        # wait a switch interval per call to win it back from busy threads.
        if parts:  # none while a graph is captured
            torch.cat(list(parts), out=self.input[:rows])
        self.fill_slots(token_slots, rows, pad_to)
        return rows

    def fill_addresses(
        self, parts: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], pad_to: int
    ) -> int:
        """The addresses of the parts' rows (gathered) and of the outputs' rows (scattered),
        one request after the other, 0 from there up to ``pad_to``; returns the rows. Every
        tensor must be memory the device reaches at its own address."""
        self._grow(pad_to)
        rows = row_addresses(parts, self.sources[:pad_to])
        if row_addresses(outputs, self.dests[:pad_to]) != rows:
            raise ValueError("the outputs' rows differ from the inputs'")
        return rows

    def fill_slots(self, token_slots: torch.Tensor | None, rows: int, pad_to: int = 0) -> None:
        """The slot ids of ``rows`` rows (-1 for all when None), -1 from there to ``pad_to``
        (for launches whose rows reach the device another way)."""
        self._grow(max(rows, pad_to))
        padded = max(rows, pad_to)
        if token_slots is None:
            self.slots[:padded].fill_(-1)
        else:
            self.slots[:rows].copy_(token_slots)
            self.slots[rows:padded].fill_(-1)

    def routing(self, routing: Routing) -> Routing:
        """The caller's routing, copied into page-locked buffers (views valid until the next
        call)."""
        ids, weights = routing.topk_ids, routing.topk_weights
        if self._topk_ids.numel() < ids.numel():
            self._topk_ids = torch.empty(ids.numel(), dtype=torch.int32).pin_memory()
        if self._topk_weights.numel() < weights.numel():
            self._topk_weights = torch.empty(weights.numel(), dtype=torch.float32).pin_memory()
        pinned_ids = self._topk_ids[: ids.numel()].view(ids.shape)
        pinned_weights = self._topk_weights[: weights.numel()].view(weights.shape)
        pinned_ids.copy_(ids)
        pinned_weights.copy_(weights)
        return Routing(topk_ids=pinned_ids, topk_weights=pinned_weights)
