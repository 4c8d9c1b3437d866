"""Where PEFT adapters are packed into the executor's slot layout.

``pack_adapter`` validates with ``shared.adapter_format.inspect_adapter`` and
``check_finite``, then builds, per adapted MoE layer and on the CPU, the tensors the slot
manager copies into ``kernels.LoRASlots`` (zero-padding the rank to the slot's):

    a13 (E, r13, H)    b13 (E, 2I, r13)   rows [gate; up]
    a2  (E, r2, I)     b2  (E, H, r2)

so that for a token x routed to expert e: ``g_u += b13[e] @ (a13[e] @ x)`` and
``y += b2[e] @ (a2[e] @ act(g_u))``. The LoRA scaling (alpha/r, or alpha/sqrt(r) with rslora)
is folded into B in float32 before the cast to the serving dtype.

* 3D pairs: ``A.reshape(E, r, in)`` (expert-major rows) and ``B.reshape(out, r, E)`` permuted to
  (E, out, r) (rank-major columns: expert e owns columns e, e+E, ...). gpt_oss's gate_up B rows
  are interleaved like its weights, so they are de-interleaved (even rows gate, odd rows up).
* 2D pairs: gate_proj and up_proj go block-diagonally into one w13 LoRA — A rows
  [A_gate; A_up], B columns [B_gate | 0] for the gate rows and [0 | B_up] for the up rows, rank
  r_gate + r_up, as PEFT does on load; experts of lower rank are zero-padded to the layer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.adapter_format import (
    LayerLayout,
    LoRAPair,
    Projection,
    check_finite,
    inspect_adapter,
)
from shared.errors import InvalidArgument
from shared.model_spec import ModelSpec
from shared.safetensors_header import SafetensorsHeader, parse_bytes

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


def pack_adapter(
    config: Mapping[str, Any],
    weights: bytes | memoryview | Path,
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    only: frozenset[int] | None = None,
) -> PackedAdapter:
    """Check a PEFT adapter (adapter_config.json parsed, adapter_model.safetensors as bytes
    or a path) against ``spec`` and pack it; ``only``: pack just those layers (a layer-sharded
    executor), though the whole adapter is checked. Raises InvalidArgument naming the tensor."""
    data = weights.read_bytes() if isinstance(weights, Path) else weights
    header = parse_bytes(data)
    layout = inspect_adapter(config, header, spec, max_rank)
    check_finite(header, data)
    layers = {
        index: _pack_layer(layer, header, data, spec, dtype)
        for index, layer in sorted(layout.layers.items())
        if only is None or index in only
    }
    nbytes = sum(
        tensor.numel() * tensor.element_size()
        for layer in layers.values()
        for tensor in (layer.a13, layer.b13, layer.a2, layer.b2)
        if tensor is not None
    )
    return PackedAdapter(layers=layers, rank=layout.rank, nbytes=nbytes)


def _tensor(header: SafetensorsHeader, data: bytes | memoryview, key: str) -> torch.Tensor:
    """A float32 copy of one stored tensor."""
    info = header.tensors[key]
    start = header.data_start + info.begin
    raw = bytearray(memoryview(data)[start : start + info.nbytes])  # writable: no torch warning
    stored = torch.frombuffer(raw, dtype=_TORCH_DTYPES[info.dtype]) if raw else torch.empty(0)
    return stored.reshape(info.shape).float()


def _pack_layer(
    layout: LayerLayout,
    header: SafetensorsHeader,
    data: bytes | memoryview,
    spec: ModelSpec,
    dtype: torch.dtype,
) -> PackedLayer:
    h, i = spec.hidden_size, spec.moe_intermediate_size
    w13 = [pair for pair in layout.pairs if pair.projection is not Projection.DOWN]
    w2 = [pair for pair in layout.pairs if pair.projection is Projection.DOWN]
    deinterleave = spec.type.gate_up_interleaved
    a13, b13 = _fill(w13, layout.w13_rank, h, 2 * i, spec.num_experts, deinterleave, header, data)
    a2, b2 = _fill(w2, layout.w2_rank, i, h, spec.num_experts, False, header, data)
    return PackedLayer(
        a13=_cast(a13, dtype, "a13"),
        b13=_cast(b13, dtype, "b13"),
        a2=_cast(a2, dtype, "a2"),
        b2=_cast(b2, dtype, "b2"),
    )


def _fill(
    pairs: list[LoRAPair],
    rank: int,
    fan_in: int,
    fan_out: int,
    num_experts: int,
    deinterleave: bool,
    header: SafetensorsHeader,
    data: bytes | memoryview,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A (E, rank, fan_in) and B (E, fan_out, rank) of one packed projection (float32)."""
    if not rank:
        return None, None
    if len(pairs) == 1 and pairs[0].expert is None:  # 3D: one pair covers every expert
        a, b = _pair_factors(pairs[0], header, data, num_experts)
        return a, _deinterleave(b) if deinterleave else b
    a = torch.zeros(num_experts, rank, fan_in)
    b = torch.zeros(num_experts, fan_out, rank)
    half = fan_out // 2
    rows = {Projection.GATE: slice(0, half), Projection.UP: slice(half, fan_out)}
    for pair in pairs:
        pair_a, pair_b = _pair_factors(pair, header, data, num_experts)
        experts = slice(None) if pair.expert is None else slice(pair.expert, pair.expert + 1)
        ranks = slice(pair.rank_offset, pair.rank_offset + pair.rank)
        a[experts, ranks] = pair_a
        b[experts, rows.get(pair.projection, slice(None)), ranks] = pair_b
    return a, b


def _deinterleave(b: torch.Tensor) -> torch.Tensor:
    """gpt_oss: rows of its gate_up B alternate gate, up; make them [gate; up]."""
    return torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)


def _pair_factors(
    pair: LoRAPair, header: SafetensorsHeader, data: bytes | memoryview, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (E', r, in) and scaling·B (E', out, r); E' = E for 3D pairs, 1 for 2D ones."""
    a, b = _tensor(header, data, pair.a_key), _tensor(header, data, pair.b_key)
    if pair.expert is None:
        a = a.reshape(num_experts, pair.rank, a.shape[1])
        b = b.reshape(b.shape[0], pair.rank, num_experts).permute(2, 0, 1)
    else:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    return a, b * pair.scaling


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    if tensor is None:
        return None
    # Rounding is monotonic: the largest magnitude overflows iff any value does.
    low, high = torch.aminmax(tensor)
    if not bool(torch.isfinite(torch.stack((low, high)).to(dtype)).all()):
        raise InvalidArgument(
            f"adapter LoRA {name} overflows {str(dtype).removeprefix('torch.')} once scaled"
        )
    return tensor.to(dtype, memory_format=torch.contiguous_format)
