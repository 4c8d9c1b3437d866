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
transformers keeps in float32 and so do we.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels.types import (
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
    Checkpoint,
    ExpertLayout,
    LayerTensors,
    ModelSpec,
    read_checkpoint,
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


def load_base_model(
    folder: Path,
    device: torch.device | str,
    dtype: torch.dtype,
    name: str | None = None,
    only: Sequence[int] | None = None,
) -> BaseModel:
    """Load the MoE layers of the checkpoint in ``folder`` onto ``device`` in ``dtype``;
    ``only``: just those MoE layers (``--layers``), others are never read.

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
            layers[layer] = _layer(spec, checkpoint.layout, checkpoint.layers[layer], reader)
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

    def get(self, name: str | None, keep_float32: bool = False) -> torch.Tensor:
        """One tensor on the device in the serving dtype (or float32)."""
        dtype = torch.float32 if keep_float32 else self.dtype
        return self._read(name).to(device=self.device, dtype=dtype)

    def stack(self, rows: Sequence[Sequence[str]]) -> torch.Tensor:
        """(len(rows), sum of row heights, width): ``rows[e]`` concatenated along dim 0,
        copied straight from the file into one device tensor (no intermediate stack)."""
        first = [self._checkpoint.tensors[name].info.shape for name in rows[0]]
        height, width = sum(shape[0] for shape in first), first[0][1]
        out = torch.empty(len(rows), height, width, device=self.device, dtype=self.dtype)
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
    if layout is ExpertLayout.FUSED:
        w13, w2 = get(names.gate_up), get(names.down)
    else:
        w13 = reader.stack(list(zip(names.expert_gate, names.expert_up, strict=True)))
        w2 = reader.stack([(down,) for down in names.expert_down])
    shared = None
    if names.shared_gate is not None and names.shared_up is not None:
        shared = SharedExpertWeights(
            w13=reader.stack([(names.shared_gate, names.shared_up)])[0],
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
        shared=shared,
        activation=Activation[spec.type.activation.name],
    )


def _nbytes(layer: MoELayerWeights) -> int:
    tensors = [
        layer.router_weight,
        layer.router_bias,
        layer.e_score_correction_bias,
        layer.w13,
        layer.w2,
        layer.b13,
        layer.b2,
    ]
    if layer.shared is not None:
        tensors += [layer.shared.w13, layer.shared.w2, layer.shared.gate]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
