"""Pinned (page-locked) host buffers for one launch's input, slot ids and output.

Request bytes are copied once, straight from the message into the pinned input (casting to
the compute dtype on the way when the wire dtype differs); host↔device copies from and to
pinned memory run asynchronously, so a launch needs one synchronisation, at its end. One
``Staging`` belongs to the one thread that launches work on the device (the scheduler's), and
its buffers are reused launch after launch (grown when a longer one comes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Staging:
    """Reusable pinned buffers of ``hidden_size`` columns in ``dtype``."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, rows: int) -> None:
        self._hidden = hidden_size
        self._dtype = dtype
        self._rows = 0
        self.input = self.output = self.slots = torch.empty(0)
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        if rows <= self._rows:
            return
        self._rows = rows
        self.input = torch.empty(rows, self._hidden, dtype=self._dtype).pin_memory()
        self.output = torch.empty(rows, self._hidden, dtype=self._dtype).pin_memory()
        self.slots = torch.empty(rows, dtype=torch.int32).pin_memory()

    def fill(self, parts: Sequence[torch.Tensor], token_slots: torch.Tensor | None) -> int:
        """Copies the requests' rows (and slot ids) one after the other; returns the rows."""
        rows = sum(int(p.shape[0]) for p in parts)
        self._grow(rows)
        start = 0
        for part in parts:
            end = start + int(part.shape[0])
            self.input[start:end].copy_(part)
            start = end
        if token_slots is not None:
            self.slots[:rows].copy_(token_slots)
        return rows
