"""Where a base checkpoint's MoE layers are loaded into the kernels' layout.

``load_base_model`` checks the folder with ``moelora.client.model_spec.read_checkpoint``
(config.json and the safetensors headers: a missing or misshaped tensor fails there, naming the
tensor), then reads only the MoE layers' router, experts and shared experts through memory-mapped
``safe_open`` and converts them to ``kernels.MoELayerWeights``:

* w13 (E, 2I, H) rows [gate; up], w2 (E, H, I). Per-expert checkpoints are stacked; gpt_oss's
  transposed ``gate_up_proj`` (E, H, 2I) is transposed and de-interleaved (gate = even
  columns, up = odd columns), its biases likewise.
* The router per model type (see ``kernels.routing``): softmax → top-k → renormalise iff
  norm_topk_prob (qwen2_moe, qwen3_moe, olmoe), always (mixtral); top-k → softmax with router
  bias (gpt_oss); sigmoid grouped top-k with e_score_correction_bias, n_group, topk_group and
  routed_scaling_factor (deepseek_v3).

Every tensor is cast to the serving dtype except deepseek's ``e_score_correction_bias``, which
transformers keeps in float32 and so do we, and the routed experts of an FP8 checkpoint
(F8_E4M3 with 128×128 block scales, ``weight_scale_inv``): those stay FP8 on the device with
their float32 scales stacked beside them (``MoELayerWeights.w13_scale``/``w2_scale``), which
the kernels apply, so a layer takes about half the memory of bf16. The shared expert of such a
checkpoint is dequantised to the serving dtype at load (one dense expert per layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels.fp8 import dequantize
from kernels.types import (
    FP8_DTYPE,
    Activation,
    MoELayerWeights,
    RouterKind,
    RouterSpec,
    SharedExpertWeights,
    validate_layer,
)
from moelora.client.errors import InvalidArgument
from moelora.client.layer_set import format_layers
from moelora.client.model_spec import (
    FP8_STORED_DTYPE,
    Checkpoint,
    ExpertLayout,
    LayerTensors,
    ModelSpec,
    read_checkpoint,
    scale_name,
)


@dataclass(frozen=True)
class BaseModel:
    """The MoE layers of one base checkpoint, ready for ``kernels.moe_forward``."""

    spec: ModelSpec
    name: str
    #: Decoder-layer index → weights, for every MoE layer.
    layers: Mapping[int, MoELayerWeights]
    #: Bytes of all loaded tensors on the device.
    nbytes: int

    @property
    def weight_format(self) -> str:
        """How the routed experts are held (``MoELayerWeights.weight_format``)."""
        return next(iter(self.layers.values())).weight_format


def load_base_model(
    folder: Path,
    device: torch.device | str,
    dtype: torch.dtype,
    name: str | None = None,
    only: Sequence[int] | None = None,
    fp8_activations: bool = False,
) -> BaseModel:
    """Load the MoE layers of the checkpoint in ``folder`` onto ``device`` in ``dtype``;
    ``only``: just those MoE layers (``--layers``), others are never read;
    ``fp8_activations``: the FP8 experts take their inputs quantised
    (``MoELayerWeights.fp8_activations``; ``InvalidArgument`` if they are not FP8).

    ``name`` defaults to the folder's name. Raises ``InvalidArgument`` (from read_checkpoint)
    for unsupported model types and missing or misshaped tensors, and for an ``only`` that
    names no MoE layer or a layer the model does not have.
    """
    checkpoint = read_checkpoint(folder)
    spec = checkpoint.spec
    served = served_layers(spec, only)
    layers: dict[int, MoELayerWeights] = {}
    with ExitStack() as stack:
        reader = _Reader(checkpoint, stack, torch.device(device), dtype)
        for layer in served:
            weights = _layer(spec, checkpoint.layout, checkpoint.layers[layer], reader)
            if fp8_activations and not weights.fp8:
                raise InvalidArgument(
                    f"--fp8-activations: the checkpoint's experts are "
                    f"{weights.weight_format}, not FP8",
                    "fp8_activations",
                )
            layers[layer] = dataclasses.replace(weights, fp8_activations=fp8_activations)
            validate_layer(layers[layer])
    nbytes = sum(_nbytes(weights) for weights in layers.values())
    return BaseModel(spec=spec, name=name or folder.name, layers=layers, nbytes=nbytes)


def served_layers(spec: ModelSpec, only: Sequence[int] | None) -> tuple[int, ...]:
    """The MoE layers of ``spec`` within ``only`` (all when None). Dense layers inside a range
    are skipped (a group "0-23" of a model whose first layers are dense is fine), but a layer
    past the model's last, or a set without any MoE layer, is a mistake worth stopping for."""
    if only is None:
        return spec.moe_layers
    beyond = [layer for layer in only if layer >= spec.num_layers]
    if beyond:
        raise InvalidArgument(
            f"--layers: {format_layers(beyond)} beyond the model's {spec.num_layers} layers "
            f"(MoE layers: {format_layers(spec.moe_layers)})",
            "layers",
        )
    served = tuple(layer for layer in spec.moe_layers if layer in set(only))
    if not served:
        raise InvalidArgument(
            f"--layers: {format_layers(only)} holds no MoE layer "
            f"(MoE layers: {format_layers(spec.moe_layers)})",
            "layers",
        )
    return served


def router_spec(spec: ModelSpec) -> RouterSpec:
    """The kernels' router settings for a model (RouterKind shares RouterStyle's names)."""
    return RouterSpec(
        RouterKind[spec.type.router.name],
        spec.top_k,
        renormalize=spec.norm_topk_prob,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor,
    )


class _Reader:
    """Reads checkpoint tensors (memory-mapped shards, each opened once) onto the device."""

    def __init__(
        self, checkpoint: Checkpoint, stack: ExitStack, device: torch.device, dtype: torch.dtype
    ) -> None:
        self._checkpoint = checkpoint
        self._stack = stack
        self._handles: dict[Path, Any] = {}
        self.device = device
        self.dtype = dtype

    def _read(self, name: str | None) -> torch.Tensor:
        if name is None:  # read_checkpoint names every tensor its layout has
            raise ValueError(f"{self._checkpoint.spec.model_type} layout lacks a tensor")
        path = self._checkpoint.tensors[name].path
        if path not in self._handles:
            handle = safe_open(path, framework="pt", device="cpu")
            self._handles[path] = self._stack.enter_context(handle)
        tensor: torch.Tensor = self._handles[path].get_tensor(name)
        return tensor

    def fp8(self, name: str) -> bool:
        return self._checkpoint.tensors[name].info.dtype == FP8_STORED_DTYPE

    def get(self, name: str | None, keep_float32: bool = False) -> torch.Tensor:
        """One tensor on the device in the serving dtype (or float32); an FP8 one
        dequantised with its block scales."""
        dtype = torch.float32 if keep_float32 else self.dtype
        tensor = self._read(name)
        if name is not None and self.fp8(name):
            scales = self._read(scale_name(name))
            return dequantize(tensor.to(self.device), scales.to(self.device), dtype)
        return tensor.to(device=self.device, dtype=dtype)

    def stack(
        self, rows: Sequence[Sequence[str]], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """(len(rows), sum of row heights, width): ``rows[e]`` concatenated along dim 0,
        copied straight from the file into one device tensor (no intermediate stack), in
        ``dtype`` (default: the serving dtype)."""
        first = [self._checkpoint.tensors[name].info.shape for name in rows[0]]
        height, width = sum(shape[0] for shape in first), first[0][1]
        out = torch.empty(len(rows), height, width, device=self.device, dtype=dtype or self.dtype)
        for index, names in enumerate(rows):
            start = 0
            for name in names:
                part = self._read(name)
                out[index, start : start + part.shape[0]].copy_(part)
                start += part.shape[0]
        return out


def _layer(
    spec: ModelSpec, layout: ExpertLayout, names: LayerTensors, reader: _Reader
) -> MoELayerWeights:
    get = reader.get
    if layout is ExpertLayout.FUSED_TRANSPOSED:
        w13 = get(names.gate_up).transpose(1, 2)  # (E, 2I, H)
        b13 = get(names.gate_up_bias)
        if spec.type.gate_up_interleaved:  # gate = even rows, up = odd rows
            w13 = torch.cat((w13[:, 0::2], w13[:, 1::2]), dim=1)
            b13 = torch.cat((b13[:, 0::2], b13[:, 1::2]), dim=1)
        w2 = get(names.down).transpose(1, 2).contiguous()
        return MoELayerWeights(
            router=router_spec(spec),
            router_weight=get(names.router_weight),
            router_bias=get(names.router_bias),
            w13=w13.contiguous(),
            w2=w2,
            b13=b13.contiguous(),
            b2=get(names.down_bias),
            activation=Activation[spec.type.activation.name],
            swiglu_alpha=spec.swiglu_alpha,
            swiglu_limit=spec.swiglu_limit,
        )
    w13_scale = w2_scale = None
    if layout is ExpertLayout.FUSED:
        w13, w2 = get(names.gate_up), get(names.down)
    else:
        gate_up = list(zip(names.expert_gate, names.expert_up, strict=True))
        down = [(name,) for name in names.expert_down]
        fp8 = reader.fp8(names.expert_gate[0])
        w13 = reader.stack(gate_up, FP8_DTYPE if fp8 else None)
        w2 = reader.stack(down, FP8_DTYPE if fp8 else None)
        if fp8:  # read_checkpoint checked every scale (and I % 128 == 0: gate/up blocks stack)
            w13_scale = reader.stack(_scale_rows(gate_up), torch.float32)
            w2_scale = reader.stack(_scale_rows(down), torch.float32)
    shared = None
    if names.shared_gate is not None and names.shared_up is not None:
        shared = SharedExpertWeights(
            w13=(
                torch.cat((get(names.shared_gate), get(names.shared_up)))
                if reader.fp8(names.shared_gate)  # dequantised: stack copies bytes as they are
                else reader.stack([(names.shared_gate, names.shared_up)])[0]
            ),
            w2=get(names.shared_down),
            gate=None if names.shared_expert_gate is None else get(names.shared_expert_gate),
        )
    correction = names.score_correction_bias
    return MoELayerWeights(
        router=router_spec(spec),
        router_weight=get(names.router_weight),
        e_score_correction_bias=None if correction is None else get(correction, keep_float32=True),
        w13=w13,
        w2=w2,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        shared=shared,
        activation=Activation[spec.type.activation.name],
    )


def _scale_rows(rows: Sequence[Sequence[str]]) -> list[list[str]]:
    """The block-scale tensors of ``_Reader.stack``'s rows of FP8 weights, row for row."""
    return [[scale_name(name) for name in row] for row in rows]


def _nbytes(layer: MoELayerWeights) -> int:
    tensors = [
        layer.router_weight,
        layer.router_bias,
        layer.e_score_correction_bias,
        layer.w13,
        layer.w2,
        layer.b13,
        layer.b2,
        layer.w13_scale,
        layer.w2_scale,
    ]
    if layer.shared is not None:
        tensors += [layer.shared.w13, layer.shared.w2, layer.shared.gate]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
