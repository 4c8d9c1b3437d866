"""The entry point: one MoE layer (router, experts, LoRA, shared expert) for a batch of tokens."""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from kernels.align import align_pairs, pair_blocks
from kernels.config_select import ConfigSelector, quantised_inputs, selector_for
from kernels.configs import MoEConfig, fit_stages
from kernels.fused_moe import LoRABuffers, fused_experts
from kernels.model_shape import LayerShape
from kernels.reference import moe_forward_reference
from kernels.routing import route
from kernels.shared_expert import shared_expert_forward
from kernels.types import LoRAContext, MoELayerWeights, Routing, validate_forward_inputs

Backend = Literal["triton", "torch"]


def _triton_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def fused_moe(
    hidden: torch.Tensor,
    layer: MoELayerWeights,
    lora: LoRAContext | None,
    routing: Routing,
    config: MoEConfig,
) -> torch.Tensor:
    """The Triton path with an explicit launch configuration (inputs already validated).

    Returns (T, H) in hidden's dtype. The routed experts are summed in float32 and the shared
    expert (computed by torch in hidden's dtype) is added before the one final rounding.
    ``config.decode`` runs the GEMMs over one block per pair (``kernels.align.pair_blocks``:
    no alignment launch), else over the expert-sorted blocks of ``kernels.align.align_pairs``.
    FP8 experts run W8A16, or W8A8 where ``config`` quantises the inputs (``kernels.fused_moe``):
    ``config`` must come through ``kernels.configs.fit_stages`` with ``fp8=True`` (block_k
    dividing 128).
    """
    slots = None if lora is None else lora.slots
    token_slots = None if lora is None else lora.token_slots
    enabled = None if slots is None else slots.enabled
    if config.decode:
        alignment = pair_blocks(routing.topk_ids.contiguous(), token_slots, enabled)
    else:
        alignment = align_pairs(
            routing.topk_ids, layer.num_experts, config.block_m, token_slots, enabled
        )
    buffers = None
    if slots is not None and alignment.row_slots is not None:
        buffers = LoRABuffers(slots.a13, slots.b13, slots.a2, slots.b2, alignment.row_slots)
    shared = None
    if layer.shared is not None:
        shared = shared_expert_forward(hidden, layer.shared, hidden.dtype)
    return fused_experts(
        hidden.contiguous(),
        layer.w13.contiguous(),
        layer.w2.contiguous(),
        layer.b13,
        layer.b2,
        layer.activation,
        layer.swiglu_alpha,
        layer.swiglu_limit,
        routing.topk_weights.contiguous(),
        alignment,
        buffers,
        config,
        addend=shared,
        w13_scale=layer.w13_scale,
        w2_scale=layer.w2_scale,
    )


def moe_forward(
    hidden: torch.Tensor,
    layer: MoELayerWeights,
    lora: LoRAContext | None = None,
    routing: Routing | None = None,
    *,
    backend: Backend = "triton",
    configs: ConfigSelector | None = None,
    check_layer: bool = True,
) -> torch.Tensor:
    """One MoE layer: hidden (T, H) → (T, H) in hidden's dtype.

    routing: precomputed top-k ids/weights, else ``route(hidden, layer)``.
    lora: per-token adapter slots, else no LoRA.
    backend: "triton" (CUDA tensors, on any GPU whether current or not, or any under
    TRITON_INTERPRET=1) or "torch" (the float32 reference, for CPUs; FP8 experts are
    dequantised per expert). FP8 experts with ``fp8_activations`` take their inputs
    quantised on either (``kernels.config_select.quantised_inputs``).
    configs: where launch configurations come from (the executor's, with its autotuned ones);
    default: this GPU's tuned table, else the heuristic.
    check_layer: False for a layer validated once at load (``kernels.validate_layer``).

    Raises ValueError for inconsistent inputs (see ``kernels.types.validate_forward_inputs``).
    """
    validate_forward_inputs(hidden, layer, lora, routing, check_layer=check_layer)
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    if routing is None:
        routing = route(hidden, layer)
    if backend == "torch":
        return moe_forward_reference(hidden, layer, lora, routing)
    if not _triton_can_run(hidden.device):
        raise ValueError(
            f"the triton backend needs CUDA tensors (hidden states are on {hidden.device}); "
            "use backend='torch' on the CPU"
        )
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    rank = 0 if lora is None else lora.slots.max_rank
    selector = configs if configs is not None else selector_for(hidden.device)
    config = selector.select(hidden.shape[0], layer_shape(layer), rank, hidden.dtype).config
    config = as_run(config, layer, rank)
    if hidden.device.type != "cuda":
        return fused_moe(hidden, layer, lora, routing, config)
    # Triton launches on the current device's stream and context: tensors on another GPU
    # (a model placed on cuda:1) would be pointers it cannot read.
    with torch.cuda.device(hidden.device):
        return fused_moe(hidden, layer, lora, routing, config)


def as_run(config: MoEConfig, layer: MoELayerWeights, rank: int) -> MoEConfig:
    """``config`` (fitted to ``layer``'s shape) as a forward of ``layer`` runs it: with
    ``fp8_activations`` in its W8A8 form (``kernels.config_select.quantised_inputs``)."""
    if not layer.fp8_activations:
        return config
    return _quantised_form(config, layer.w13.device, layer.dtype.itemsize, rank)


@functools.cache
def _quantised_form(
    config: MoEConfig, device: torch.device, elem_size: int, rank: int
) -> MoEConfig:
    """``as_run``'s W8A8 form, made once per configuration (an eager Forward asks each
    launch)."""
    return fit_stages(quantised_inputs(config, device), elem_size, rank, fp8=True)


def layer_shape(layer: MoELayerWeights) -> LayerShape:
    return LayerShape(
        layer.num_experts,
        layer.hidden_size,
        layer.intermediate_size,
        layer.router.top_k,
        fp8=layer.fp8,
    )
