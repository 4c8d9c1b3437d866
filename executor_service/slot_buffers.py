"""Where adapters are written into the GPU slot buffers, and how that is ordered on the device.

One ``kernels.LoRASlots`` per MoE layer, allocated once at start-up:
a13 (S, E, R, H), b13 (S, E, 2I, R), a2 (S, E, R, I), b2 (S, E, H, R), enabled (S,) —
S·E·R·(2H + 3I) elements per layer. Writing slot s copies each layer's packed A/B into
``[s, :, :r]`` (B: ``[s, ..., :r]``), zeroes the rest of the rank and sets ``enabled[s]``.

On CUDA the copies run on a side stream, so that loading overlaps the compute of requests
using other slots, enqueued all at once (``bulk_copy.py``): requests move their own input and
output without the copy engines, so nothing of theirs waits behind a slot write. The writing
thread (the request that needs the adapter, or LoadAdapter's) returns once the copies are
enqueued. Events order it: a write first waits
for the events recorded after the last kernels that read the slot, and records a ``ready``
event that the kernels using the new adapter wait for. On the CPU everything is synchronous
and the events are None.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from executor_service.bulk_copy import copy_in_pieces
from executor_service.packer import PackedAdapter, PackedLayer
from kernels import LoRASlots, MoELayerWeights
from moelora.client.logs import log_event

log = logging.getLogger(__name__)

#: A CUDA event, or None on the CPU (where work is done when the call returns).
DeviceEvent = torch.cuda.Event | None


@dataclass(frozen=True)
class SlotGeometry:
    """The shape every layer's slot buffers share."""

    num_slots: int
    max_rank: int
    num_experts: int
    hidden_size: int
    intermediate_size: int

    @property
    def elements_per_layer(self) -> int:
        s, e, r = self.num_slots, self.num_experts, self.max_rank
        return s * e * r * (2 * self.hidden_size + 3 * self.intermediate_size)


class DeviceSync:
    """Stream and event plumbing, so that the rest of the executor has no CUDA branches."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    def on_device(self) -> contextlib.AbstractContextManager[object]:
        """Makes the executor's GPU current in the calling thread: kernels launch on the
        current device, and gRPC worker threads start on cuda:0."""
        if self.copy_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def record(self) -> DeviceEvent:
        """An event after the work issued so far on the current stream (None on the CPU)."""
        if self.copy_stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, events: Iterable[DeviceEvent]) -> None:
        """Makes the current stream wait for ``events`` (a no-op on the CPU)."""
        if self.copy_stream is None:
            return
        stream = torch.cuda.current_stream(self.device)
        for event in events:
            if event is not None:
                stream.wait_event(event)

    @staticmethod
    def pending(events: Iterable[DeviceEvent]) -> list[DeviceEvent]:
        """The events whose work has not finished yet."""
        return [e for e in events if e is not None and not e.query()]  # type: ignore[no-untyped-call]


class SlotBuffers:
    """The slot buffers of every MoE layer, on one device, in one dtype."""

    def __init__(
        self,
        layers: Mapping[int, MoELayerWeights],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        sync: DeviceSync,
    ) -> None:
        if not layers:
            raise ValueError("the base model has no MoE layers")
        first = next(iter(layers.values()))
        self.geometry = SlotGeometry(
            num_slots=num_slots,
            max_rank=max_rank,
            num_experts=first.num_experts,
            hidden_size=first.hidden_size,
            intermediate_size=first.intermediate_size,
        )
        self.sync = sync
        self.dtype = dtype
        s, r = num_slots, max_rank
        e, h, i = first.num_experts, first.hidden_size, first.intermediate_size

        def zeros(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=kind, device=sync.device)

        self._layers = {
            index: LoRASlots(
                a13=zeros(s, e, r, h),
                b13=zeros(s, e, 2 * i, r),
                a2=zeros(s, e, r, i),
                b2=zeros(s, e, h, r),
                enabled=zeros(s, kind=torch.int32),
            )
            for index in sorted(layers)
        }
        self.nbytes = sum(
            t.numel() * t.element_size()
            for slots in self._layers.values()
            for t in (slots.a13, slots.b13, slots.a2, slots.b2, slots.enabled)
        )
        #: The most one packed adapter can take: a slot's share.
        self.slot_bytes = self.nbytes // s
        log_event(
            log,
            "slot_buffers_allocated",
            device=str(sync.device),
            dtype=str(dtype).removeprefix("torch."),
            num_slots=s,
            max_rank=r,
            moe_layers=len(self._layers),
            elements_per_layer=self.geometry.elements_per_layer,
            bytes=self.nbytes,
            gib=round(self.nbytes / 1024**3, 3),
        )

    def layer(self, index: int) -> LoRASlots:
        return self._layers[index]

    def write(self, slot: int, packed: PackedAdapter, after: Iterable[DeviceEvent]) -> DeviceEvent:
        """Writes ``packed`` into ``slot`` of every layer once ``after`` completed; returns the
        event that marks the write done (None on the CPU, where it is done on return)."""
        stream = self.sync.copy_stream
        if stream is None:
            self._copy(slot, packed)
            return None
        with self.sync.on_device(), torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            self._copy(slot, packed, copy_in_pieces)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(stream)
        return ready

    def _copy(self, slot: int, packed: PackedAdapter, copy: Copy = torch.Tensor.copy_) -> None:
        for index, slots in self._layers.items():
            part = packed.layers.get(index, _EMPTY_LAYER)
            _put_a(slots.a13[slot], part.a13, copy)
            _put_b(slots.b13[slot], part.b13, copy)
            _put_a(slots.a2[slot], part.a2, copy)
            _put_b(slots.b2[slot], part.b2, copy)
            used = any(t is not None for t in (part.a13, part.a2))
            slots.enabled[slot].fill_(1 if used else 0)


_EMPTY_LAYER = PackedLayer(a13=None, b13=None, a2=None, b2=None)

#: dest ← source.
Copy = Callable[[torch.Tensor, torch.Tensor], object]


def _put_a(dest: torch.Tensor, source: torch.Tensor | None, copy: Copy) -> None:
    """dest (E, R, in) ← source (E, r, in), rows r.. zeroed; all zero without a source."""
    rank = 0 if source is None else source.shape[1]
    if source is not None:
        copy(dest[:, :rank], source)
    dest[:, rank:].zero_()


def _put_b(dest: torch.Tensor, source: torch.Tensor | None, copy: Copy) -> None:
    """dest (E, out, R) ← source (E, out, r), columns r.. zeroed."""
    rank = 0 if source is None else source.shape[2]
    if source is not None:
        copy(dest[:, :, :rank], source)
    dest[:, :, rank:].zero_()
