"""Where PEFT adapters are packed into the executor's slot layout.

``pack_adapter`` validates with ``shared.adapter_format.inspect_adapter`` and
``check_finite``, then builds, per adapted MoE layer and on the CPU, the tensors the slot
manager copies into ``kernels.LoRASlots`` (zero-padding the rank to the slot's):

    a13 (E, r13, H)    b13 (E, 2I, r13)   rows [gate; up]
    a2  (E, r2, I)     b2  (E, H, r2)

so that for a token x routed to expert e: ``g_u += b13[e] @ (a13[e] @ x)`` and
``y += b2[e] @ (a2[e] @ act(g_u))``. The LoRA scaling (alpha/r, or alpha/sqrt(r) with rslora)
is folded into B in float32 before the cast to the serving dtype.

Speed (the cold-start path): a weights file is parsed in place from a copy-on-write memory map
(``torch.frombuffer``: no whole-file read, no per-tensor copy), each packed tensor is written
once, straight into its final buffer in the serving dtype (page-locked when ``pin``), and one
check on that output catches both NaN/Inf in the input and overflow from the scaling. Weights
still being downloaded (``Arriving``) are packed tensor by tensor, in the order they lie in the
file, each as soon as its bytes have arrived.

* 3D pairs: ``A.reshape(E, r, in)`` (expert-major rows) and ``B.reshape(out, r, E)`` permuted to
  (E, out, r) (rank-major columns: expert e owns columns e, e+E, ...). gpt_oss's gate_up B rows
  are interleaved like its weights, so they are de-interleaved (even rows gate, odd rows up).
* 2D pairs: gate_proj and up_proj go block-diagonally into one w13 LoRA — A rows
  [A_gate; A_up], B columns [B_gate | 0] for the gate rows and [0 | B_up] for the up rows, rank
  r_gate + r_up, as PEFT does on load; experts of lower rank are zero-padded to the layer's.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from shared.adapter_format import (
    LayerLayout,
    LoRAPair,
    Projection,
    inspect_adapter,
)
from shared.errors import InvalidArgument
from shared.model_spec import ModelSpec
from shared.safetensors_header import (
    PREFIX_BYTES,
    SafetensorsHeader,
    header_length,
    parse_bytes,
)

_TORCH_DTYPES = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


@dataclass(frozen=True)
class PackedLayer:
    """One MoE layer of a packed adapter: CPU tensors in the serving dtype, scaling in B.

    a13 (E, r13, H), b13 (E, 2I, r13) rows [gate; up]; a2 (E, r2, I), b2 (E, H, r2).
    A pair is None where the adapter leaves that projection alone.
    """

    a13: torch.Tensor | None
    b13: torch.Tensor | None
    a2: torch.Tensor | None
    b2: torch.Tensor | None


@dataclass(frozen=True)
class PackedAdapter:
    """A packed adapter: the adapted MoE layers (others absent), the largest packed rank
    (what must fit a slot) and the bytes of all tensors."""

    layers: Mapping[int, PackedLayer]
    rank: int
    nbytes: int


class Arriving(Protocol):
    """A weights file still being downloaded: the whole file's buffer, and a wait for a range
    of it to have arrived (raising the download's error if it failed)."""

    def view(self) -> memoryview: ...

    def wait(self, begin: int, end: int) -> None: ...


def pack_adapter(
    config: Mapping[str, Any],
    weights: bytes | memoryview | Path | Arriving,
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    only: frozenset[int] | None = None,
    pin: bool = False,
) -> PackedAdapter:
    """Check a PEFT adapter (adapter_config.json parsed, adapter_model.safetensors as bytes,
    a path or arriving) against ``spec`` and pack it, into page-locked memory when ``pin``;
    ``only``: pack just those layers (a layer-sharded executor), though the whole adapter is
    checked. Raises InvalidArgument naming the tensor."""
    data, wait = _buffer(weights)
    wait(0, PREFIX_BYTES)
    wait(PREFIX_BYTES, PREFIX_BYTES + header_length(data))
    header = parse_bytes(data)
    layout = inspect_adapter(config, header, spec, max_rank)
    packing = _Packing(header, data, wait, spec, dtype, pin)
    layers = {}
    # In file order: arriving weights come front to back, and each tensor waits for its bytes.
    for index, layer in sorted(layout.layers.items(), key=lambda item: _start(header, item[1])):
        if only is None or index in only:
            layers[index] = packing.layer(layer)
        else:
            packing.check_finite(layer)
    nbytes = sum(
        tensor.numel() * tensor.element_size()
        for layer in layers.values()
        for tensor in (layer.a13, layer.b13, layer.a2, layer.b2)
        if tensor is not None
    )
    return PackedAdapter(layers=layers, rank=layout.rank, nbytes=nbytes)


def _arrived(_begin: int, _end: int) -> None:
    pass


def _buffer(
    weights: bytes | memoryview | Path | Arriving,
) -> tuple[bytes | memoryview, Callable[[int, int], None]]:
    """The weights as a buffer, and the wait for a range of it. A file is memory-mapped
    copy-on-write (writable as torch.frombuffer wants, never written, so nothing is copied);
    the map is unmapped when the last tensor viewing it is gone, not closed here, since a
    traceback may hold one."""
    if isinstance(weights, bytes | memoryview):
        return weights, _arrived
    if not isinstance(weights, Path):
        return weights.view(), weights.wait
    with weights.open("rb") as handle:
        if handle.seek(0, 2) == 0:
            return b"", _arrived
        return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)), _arrived


def _start(header: SafetensorsHeader, layer: LayerLayout) -> int:
    """Where a layer's first tensor lies in the data section."""
    return min(header.tensors[key].begin for p in layer.pairs for key in (p.a_key, p.b_key))


class _Packing:
    """Packs the layers of one adapter from its parsed buffer."""

    def __init__(
        self,
        header: SafetensorsHeader,
        data: bytes | memoryview,
        wait: Callable[[int, int], None],
        spec: ModelSpec,
        dtype: torch.dtype,
        pin: bool,
    ) -> None:
        self.header = header
        self.data = data
        self.wait = wait
        self.spec = spec
        self.dtype = dtype
        self.pin = pin

    def layer(self, layout: LayerLayout) -> PackedLayer:
        h, i, e = self.spec.hidden_size, self.spec.moe_intermediate_size, self.spec.num_experts
        w13 = [pair for pair in layout.pairs if pair.projection is not Projection.DOWN]
        w2 = [pair for pair in layout.pairs if pair.projection is Projection.DOWN]
        deinterleave = self.spec.type.gate_up_interleaved
        a13, b13 = self._fill(w13, layout.w13_rank, h, 2 * i, e, deinterleave, ("a13", "b13"))
        a2, b2 = self._fill(w2, layout.w2_rank, i, h, e, False, ("a2", "b2"))
        return PackedLayer(a13=a13, b13=b13, a2=a2, b2=b2)

    def check_finite(self, layout: LayerLayout) -> None:
        """The check packing makes, for a layer that is not packed."""
        for pair in layout.pairs:
            for key in (pair.a_key, pair.b_key):
                if not bool(torch.isfinite(self._tensor(key)).all()):
                    raise InvalidArgument(f"tensor {key} contains NaN or Inf values")

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.pin)

    def _fill(
        self,
        pairs: list[LoRAPair],
        rank: int,
        fan_in: int,
        fan_out: int,
        num_experts: int,
        deinterleave: bool,
        names: tuple[str, str],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A (E, rank, fan_in) and B (E, fan_out, rank) of one packed projection."""
        if not rank:
            return None, None
        a = self._empty(num_experts, rank, fan_in)
        b = self._empty(num_experts, fan_out, rank)
        if len(pairs) == 1 and pairs[0].expert is None:  # 3D: one pair covers every expert
            pair = pairs[0]
            a.copy_(self._tensor(pair.a_key).reshape(num_experts, pair.rank, fan_in))
            stored = self._tensor(pair.b_key)
            factor = stored.reshape(stored.shape[0], pair.rank, num_experts).permute(2, 0, 1)
            if deinterleave:
                factor = torch.cat((factor[:, 0::2], factor[:, 1::2]), dim=1)
            _scaled_into(b, factor, pair.scaling)
        else:
            a.zero_()
            b.zero_()
            half = fan_out // 2
            rows = {Projection.GATE: slice(0, half), Projection.UP: slice(half, fan_out)}
            for pair in pairs:
                experts = (
                    slice(None) if pair.expert is None else slice(pair.expert, pair.expert + 1)
                )
                ranks = slice(pair.rank_offset, pair.rank_offset + pair.rank)
                a[experts, ranks] = self._tensor(pair.a_key)
                _scaled_into(
                    b[experts, rows.get(pair.projection, slice(None)), ranks],
                    self._tensor(pair.b_key),
                    pair.scaling,
                )
        self._check(a, pairs, names[0], "a_key")
        self._check(b, pairs, names[1], "b_key")
        return a, b

    def _tensor(self, key: str) -> torch.Tensor:
        """One stored tensor, a view of the buffer (bytes are copied per tensor: read-only),
        once its bytes have arrived."""
        info = self.header.tensors[key]
        start = self.header.data_start + info.begin
        self.wait(start, start + info.nbytes)
        view = memoryview(self.data)[start : start + info.nbytes]
        # torch.frombuffer wants a writable buffer: copy bytes (the memory map is writable).
        raw = bytearray(view) if view.readonly else view
        if not info.nbytes:
            return torch.empty(info.shape, dtype=_TORCH_DTYPES[info.dtype])
        return torch.frombuffer(raw, dtype=_TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def _check(self, packed: torch.Tensor, pairs: list[LoRAPair], name: str, key: str) -> None:
        """Non-finite output means a non-finite input (named) or an overflow of the cast."""
        # A reduction, as NaN propagates through min/max: many times faster than isfinite.
        if bool(torch.isfinite(torch.stack(torch.aminmax(packed))).all()):
            return
        for pair in pairs:
            tensor_key = getattr(pair, key)
            if not bool(torch.isfinite(self._tensor(tensor_key)).all()):
                raise InvalidArgument(f"tensor {tensor_key} contains NaN or Inf values")
        raise InvalidArgument(
            f"adapter LoRA {name} overflows {str(self.dtype).removeprefix('torch.')} once scaled"
        )


def _scaled_into(out: torch.Tensor, factor: torch.Tensor, scaling: float) -> None:
    """out (E', rows, r) ← scaling·factor, as if computed in float32 and rounded once to out's
    dtype, a band of rows at a time: a 3D B is a transposing gather (stride E), several times
    faster when a band's source rows stay in the CPU's cache.

    One pass (gather, scale, round) when out has factor's dtype: torch computes a reduced
    float type in float32 and rounds once. When out is float32, the widening copy is exact and
    the scaling follows in place. Otherwise (narrowing) the band goes through float32."""
    factor = factor.expand(out.shape)  # a 2D pair's (rows, r) fills one expert's (1, rows, r)
    rows = factor.shape[1]
    row_bytes = max(1, factor[:, :1].numel() * factor.element_size())
    step = max(1, _BAND_BYTES // row_bytes)
    for start in range(0, rows, step):
        band = slice(start, start + step)
        if out.dtype == factor.dtype:
            torch.mul(factor[:, band], scaling, out=out[:, band])
        elif out.dtype == torch.float32:
            out[:, band].copy_(factor[:, band]).mul_(scaling)
        else:
            out[:, band].copy_(factor[:, band].to(torch.float32, copy=True).mul_(scaling))


#: Source bytes of one band of ``_scaled_into``: about a core's share of the L2 cache (measured:
#: 0.4-0.8 MB bands gather 1.7x faster than 2 MB float32 ones).
_BAND_BYTES = 512 << 10
