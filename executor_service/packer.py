"""Where PEFT adapters are packed into the executor's slot layout.

``pack_adapter`` validates with ``shared.adapter_format.inspect_adapter`` and builds, per
adapted MoE layer, the tensors the slot manager copies into ``kernels.LoRASlots``
(zero-padding the rank to the slot's):

    a13 (E, r13, H)    b13 (E, 2I, r13)   rows [gate; up]
    a2  (E, r2, I)     b2  (E, H, r2)

so that for a token x routed to expert e: ``g_u += b13[e] @ (a13[e] @ x)`` and
``y += b2[e] @ (a2[e] @ act(g_u))``. The LoRA scaling (alpha/r, or alpha/sqrt(r) with rslora)
is folded into B in float32 before the one rounding to the serving dtype.

Where the arithmetic runs is the ``device`` argument (``pack_device.py``): the executor packs
where it computes. On the CPU each packed tensor is written once, straight into its host
buffer; on a CUDA device the stored bytes go to the GPU through pinned staging, the packing
runs there on a side stream, and each packed layer comes back into page-locked host tensors.
The same ops run on either device, so the results are bit-identical. Either way the weights
file is parsed in place (a copy-on-write memory map, or a file still arriving: packed in file
order, waiting for the bytes it needs), and one check on each packed tensor catches both
NaN/Inf in the input and overflow from the scaling.

* 3D pairs: ``A.reshape(E, r, in)`` (expert-major rows) and ``B.reshape(out, r, E)`` permuted to
  (E, out, r) (rank-major columns: expert e owns columns e, e+E, ...). That permutation is a
  transpose of B seen as (out·r, E) into (E, out·r), done a band of B's rows at a time: a
  blocked transpose into a scratch that stays in cache, then the scaling from there (the
  strided gather straight from B ran at a third of the speed on the CPU). gpt_oss's gate_up B
  rows are interleaved like its weights, so they are de-interleaved (even rows gate, odd rows
  up).
* 2D pairs: gate_proj and up_proj go block-diagonally into one w13 LoRA — A rows
  [A_gate; A_up], B columns [B_gate | 0] for the gate rows and [0 | B_up] for the up rows, rank
  r_gate + r_up, as PEFT does on load; experts of lower rank are zero-padded to the layer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from executor_service.host_pool import HostPool
from executor_service.pack_device import (
    PackDevice,
    Read,
    StoredTensors,
    Wait,
    file_reader,
    open_weights,
    pack_device,
)
from executor_service.page_cache_dma import MappedFile, open_for_dma
from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import ModelSpec
from moelora.client.safetensors_header import (
    PREFIX_BYTES,
    SafetensorsHeader,
    header_length,
    parse_bytes,
)
from shared.adapter_format import (
    LayerLayout,
    LoRAPair,
    Projection,
    inspect_adapter,
)


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

    @property
    def path(self) -> Path | None:
        """The file the bytes arrive in (a CUDA pack reads it with pread); None: memory only."""
        ...


def pack_adapter(
    config: Mapping[str, Any],
    weights: bytes | memoryview | Path | Arriving,
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    only: frozenset[int] | None = None,
    device: torch.device | str = "cpu",
    page_cache_dma: bool = False,
    memory: HostPool | None = None,
) -> PackedAdapter:
    """Check a PEFT adapter (adapter_config.json parsed, adapter_model.safetensors as bytes,
    a path or arriving) against ``spec`` and pack it on ``device`` (the CPU, or a CUDA device)
    into host tensors from ``memory`` (the host cache's pool; None: fresh memory, page-locked
    for a CUDA device). ``only``: pack just
    those layers (a layer-sharded executor), though the whole adapter is checked. Raises
    InvalidArgument naming the tensor. ``page_cache_dma``: a CUDA pack of a file copies from
    its page cache where the driver allows (page_cache_dma.py), else through staging buffers."""
    if isinstance(weights, bytes | memoryview | Path):
        data, wait = open_weights(weights)
        path = weights if isinstance(weights, Path) else None
    else:
        data, wait, path = weights.view(), weights.wait, weights.path
    device = torch.device(device)
    if memory is None:
        memory = HostPool(0, device)
    on_gpu = path if device.type == "cuda" else None
    with (
        file_reader(on_gpu) as read,
        open_for_dma(on_gpu if page_cache_dma else None, device) as pages,
    ):
        return _pack(config, data, wait, read, pages, spec, max_rank, dtype, only, memory, device)


def _pack(
    config: Mapping[str, Any],
    data: memoryview,
    wait: Wait,
    read: Read | None,
    pages: MappedFile | None,
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    only: frozenset[int] | None,
    memory: HostPool,
    device: torch.device,
) -> PackedAdapter:
    wait(0, PREFIX_BYTES)
    wait(PREFIX_BYTES, PREFIX_BYTES + header_length(data))
    header = parse_bytes(data)
    layout = inspect_adapter(config, header, spec, max_rank)
    stored = StoredTensors(header, data, wait, read, pages)
    work = pack_device(device, stored, dtype, memory)
    packing = _Packing(stored, work, spec, dtype)
    layers = {}
    # In file order: arriving weights come front to back, and each waits for its bytes.
    ordered = sorted(layout.layers.items(), key=lambda item: _start(header, item[1]))
    work.expect(
        [
            shape
            for index, layer in ordered
            if only is None or index in only
            for shape in packing.shapes(layer)
        ]
    )
    with work.running():
        for index, layer in ordered:
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


def _start(header: SafetensorsHeader, layer: LayerLayout) -> int:
    """Where a layer's first tensor lies in the data section."""
    return min(header.tensors[key].begin for p in layer.pairs for key in (p.a_key, p.b_key))


def _ab_shapes(
    num_experts: int, rank: int, fan_in: int, fan_out: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The packed A (E, rank, fan_in) and B (E, fan_out, rank) of one projection."""
    return (num_experts, rank, fan_in), (num_experts, fan_out, rank)


def _keys(layout: LayerLayout) -> list[str]:
    return [key for pair in layout.pairs for key in (pair.a_key, pair.b_key)]


@dataclass(frozen=True)
class _Check:
    """A packed tensor whose finiteness is read once the layer's work is done."""

    name: str
    pairs: list[LoRAPair]
    #: ``a_key`` or ``b_key``: which stored tensor of each pair fed it.
    key: str
    #: A 0-dim bool tensor on the work device: every value finite.
    finite: torch.Tensor


class _Packing:
    """Packs the layers of one adapter from its stored tensors on a pack device."""

    def __init__(
        self, stored: StoredTensors, work: PackDevice, spec: ModelSpec, dtype: torch.dtype
    ) -> None:
        self.stored = stored
        self.work = work
        self.spec = spec
        self.dtype = dtype

    def layer(self, layout: LayerLayout) -> PackedLayer:
        e = self.spec.num_experts
        w13 = [pair for pair in layout.pairs if pair.projection is not Projection.DOWN]
        w2 = [pair for pair in layout.pairs if pair.projection is Projection.DOWN]
        deinterleave = self.spec.type.gate_up_interleaved
        (r13, in13, out13), (r2, in2, out2) = self._dims(layout)
        checks: list[_Check] = []
        self.work.begin_layer(_keys(layout))
        a13, b13 = self._fill(w13, r13, in13, out13, e, deinterleave, "13", checks)
        a2, b2 = self._fill(w2, r2, in2, out2, e, False, "2", checks)
        self.work.end_layer()
        # Read after the layer's work finished: on a GPU, one wait per layer.
        for check in checks:
            if not bool(check.finite):
                self._refuse(check)
        return PackedLayer(a13=a13, b13=b13, a2=a2, b2=b2)

    def shapes(self, layout: LayerLayout) -> list[tuple[int, ...]]:
        """The shapes of the packed tensors of ``layer`` in the order it hands them to
        ``host``: A and B of gate/up, then of down; none for a projection of rank 0."""
        e = self.spec.num_experts
        return [
            shape
            for rank, fan_in, fan_out in self._dims(layout)
            if rank
            for shape in _ab_shapes(e, rank, fan_in, fan_out)
        ]

    def _dims(self, layout: LayerLayout) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(rank, fan_in, fan_out) of the packed gate/up projection, then of down."""
        h, i = self.spec.hidden_size, self.spec.moe_intermediate_size
        return (layout.w13_rank, h, 2 * i), (layout.w2_rank, i, h)

    def check_finite(self, layout: LayerLayout) -> None:
        """The check packing makes, for a layer that is not packed."""
        self.work.begin_layer(_keys(layout))
        flags = [(key, _finite(self.work.tensor(key))) for key in _keys(layout)]
        self.work.end_layer()
        for key, finite in flags:
            if not bool(finite):
                raise InvalidArgument(f"tensor {key} contains NaN or Inf values")

    def _fill(
        self,
        pairs: list[LoRAPair],
        rank: int,
        fan_in: int,
        fan_out: int,
        num_experts: int,
        deinterleave: bool,
        suffix: str,
        checks: list[_Check],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A (E, rank, fan_in) and B (E, fan_out, rank) of one packed projection, as host
        tensors (written once the layer ends); their checks appended to ``checks``."""
        if not rank:
            return None, None
        shape_a, shape_b = _ab_shapes(num_experts, rank, fan_in, fan_out)
        a, b = self.work.empty(shape_a), self.work.empty(shape_b)
        if len(pairs) == 1 and pairs[0].expert is None:  # 3D: one pair covers every expert
            pair = pairs[0]
            a.copy_(self.work.tensor(pair.a_key).reshape(num_experts, pair.rank, fan_in))
            _gather_b(
                b,
                self.work.tensor(pair.b_key),
                num_experts,
                deinterleave,
                pair.scaling,
                self.work.band_bytes,
            )
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
                a[experts, ranks] = self.work.tensor(pair.a_key)
                _scaled_into(
                    b[experts, rows.get(pair.projection, slice(None)), ranks],
                    self.work.tensor(pair.b_key),
                    pair.scaling,
                )
        checks.append(_Check(f"a{suffix}", pairs, "a_key", _finite(a)))
        checks.append(_Check(f"b{suffix}", pairs, "b_key", _finite(b)))
        return self.work.host(a), self.work.host(b)

    def _refuse(self, check: _Check) -> None:
        """Non-finite output means a non-finite input (named) or an overflow of the cast."""
        for pair in check.pairs:
            key = getattr(pair, check.key)
            if not bool(_finite(self.stored.host(key))):
                raise InvalidArgument(f"tensor {key} contains NaN or Inf values")
        raise InvalidArgument(
            f"adapter LoRA {check.name} overflows {str(self.dtype).removeprefix('torch.')} "
            "once scaled"
        )


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    """Whether every value is finite, as a 0-dim bool tensor on the tensor's device (no wait).
    A reduction, as NaN propagates through min/max: many times faster than isfinite."""
    if not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def _gather_b(
    out: torch.Tensor,
    stored: torch.Tensor,
    num_experts: int,
    deinterleave: bool,
    scaling: float,
    band_bytes: int,
) -> None:
    """out (E, rows, r) ← scaling·B for a 3D B stored (rows, r·E): out[e, o, k] = B[o, k·E + e].

    Seen as matrices, B is (rows·r, E) and out (E, rows·r): a transpose. Each band of B's rows
    (``band_bytes`` of them) is transposed into a scratch laid out as out's band (torch copies
    a 2D transpose in cache-sized blocks), which ``_scaled_into`` then scales into place while
    it is still in cache. gpt_oss (``deinterleave``): packed rows [gate; up] are B's even rows,
    then its odd ones."""
    rows, columns = stored.shape
    rank = columns // num_experts
    half = rows // 2
    # (first packed row, B's rows that go there)
    parts = [(0, stored[0::2]), (half, stored[1::2])] if deinterleave else [(0, stored)]
    step = max(1, min(rows, band_bytes // max(1, columns * stored.element_size())))
    scratch = torch.empty(step * columns, dtype=stored.dtype, device=stored.device)
    for first, source in parts:
        for start in range(0, source.shape[0], step):
            band = source[start : start + step]
            count = band.shape[0]
            transposed = scratch[: count * columns].view(num_experts, count * rank)
            # A view where the band's rows are adjacent; de-interleaved rows are copied.
            transposed.copy_(band.reshape(count * rank, num_experts).t())
            _scaled_into(
                out[:, first + start : first + start + count],
                transposed.view(num_experts, count, rank),
                scaling,
            )


def _scaled_into(out: torch.Tensor, factor: torch.Tensor, scaling: float) -> None:
    """out ← scaling·factor (factor broadcast to out's shape), as if computed in float32 and
    rounded once to out's dtype.

    One op (scale, round) when out has factor's dtype: torch multiplies a reduced float type in
    float32 and rounds once. When out is float32, the widening copy is exact and the scaling
    follows in place. Otherwise (narrowing) the values go through float32."""
    factor = factor.expand(out.shape)  # a 2D pair's (rows, r) fills one expert's (1, rows, r)
    if out.dtype == factor.dtype:
        torch.mul(factor, scaling, out=out)
    elif out.dtype == torch.float32:
        out.copy_(factor).mul_(scaling)
    else:
        out.copy_(factor.to(torch.float32, copy=True).mul_(scaling))
