"""Where a base checkpoint's MoE layers are loaded into the kernels' layout.

``load_base_model`` checks the folder with ``shared.model_spec.read_checkpoint`` (config.json and
the safetensors headers: a missing or misshaped tensor fails there, naming the tensor), then
reads only the MoE layers' router, experts and shared experts through memory-mapped
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

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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
from shared.model_spec import Checkpoint, ExpertLayout, LayerTensors, ModelSpec, read_checkpoint


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
    folder: Path, device: torch.device | str, dtype: torch.dtype, name: str | None = None
) -> BaseModel:
    """Load the MoE layers of the checkpoint in ``folder`` onto ``device`` in ``dtype``.

    ``name`` defaults to the folder's name. Raises ``InvalidArgument`` (from read_checkpoint)
    for unsupported model types and missing or misshaped tensors.
    """
    checkpoint = read_checkpoint(folder)
    spec = checkpoint.spec
    target = torch.device(device)
    layers: dict[int, MoELayerWeights] = {}
    with _open_tensors(checkpoint) as read:

        def get(tensor_name: str | None, keep_float32: bool = False) -> torch.Tensor:
            if tensor_name is None:  # read_checkpoint names every tensor its layout has
                raise ValueError(f"{spec.model_type} checkpoint layout lacks a tensor")
            cast = torch.float32 if keep_float32 else dtype
            return read(tensor_name).to(device=target, dtype=cast)

        for layer in spec.moe_layers:
            layers[layer] = _layer(spec, checkpoint.layout, checkpoint.layers[layer], get)
            validate_layer(layers[layer])
    nbytes = sum(_nbytes(weights) for weights in layers.values())
    return BaseModel(spec=spec, name=name or folder.name, layers=layers, nbytes=nbytes)


def router_spec(spec: ModelSpec) -> RouterSpec:
    """The kernels' router settings for a model."""
    if spec.model_type == "gpt_oss":
        return RouterSpec(RouterKind.TOPK_SOFTMAX, spec.top_k, renormalize=True)
    if spec.model_type == "deepseek_v3":
        return RouterSpec(
            RouterKind.SIGMOID_GROUPED_TOPK,
            spec.top_k,
            renormalize=spec.norm_topk_prob,
            n_group=spec.n_group,
            topk_group=spec.topk_group,
            routed_scaling_factor=spec.routed_scaling_factor,
        )
    return RouterSpec(RouterKind.SOFTMAX_TOPK, spec.top_k, renormalize=spec.norm_topk_prob)


class _Get(Protocol):
    """Reads one checkpoint tensor onto the device, cast to the serving dtype (or float32)."""

    def __call__(self, tensor_name: str | None, keep_float32: bool = False) -> torch.Tensor: ...


@contextmanager
def _open_tensors(checkpoint: Checkpoint) -> Iterator[Callable[[str], torch.Tensor]]:
    """A reader over the checkpoint's shards, each opened once."""
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str) -> torch.Tensor:
            path = checkpoint.tensors[name].path
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            tensor: torch.Tensor = handles[path].get_tensor(name)
            return tensor

        yield read


def _layer(
    spec: ModelSpec, layout: ExpertLayout, names: LayerTensors, get: _Get
) -> MoELayerWeights:
    if layout is ExpertLayout.FUSED_TRANSPOSED:
        gate_up = get(names.gate_up).transpose(1, 2)  # (E, 2I, H), rows interleaved
        w13 = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1).contiguous()
        bias = get(names.gate_up_bias)
        b13 = torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).contiguous()
        w2 = get(names.down).transpose(1, 2).contiguous()
        return MoELayerWeights(
            router=router_spec(spec),
            router_weight=get(names.router_weight),
            router_bias=get(names.router_bias),
            w13=w13,
            w2=w2,
            b13=b13,
            b2=get(names.down_bias),
            activation=Activation.GPT_OSS,
            swiglu_alpha=spec.swiglu_alpha,
            swiglu_limit=spec.swiglu_limit,
        )
    if layout is ExpertLayout.FUSED:
        w13, w2 = get(names.gate_up), get(names.down)
    else:
        w13 = torch.stack(
            [
                torch.cat((get(gate), get(up)), dim=0)
                for gate, up in zip(names.expert_gate, names.expert_up, strict=True)
            ]
        )
        w2 = torch.stack([get(down) for down in names.expert_down])
    shared = None
    if names.shared_gate is not None:
        shared = SharedExpertWeights(
            w13=torch.cat((get(names.shared_gate), get(names.shared_up)), dim=0),
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
