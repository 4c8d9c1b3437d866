"""Fused MoE + multi-LoRA forward: Triton kernels, a torch reference, tuned configs, a benchmark.

Entry point: ``moe_forward(hidden, layer, lora=None, routing=None, *, backend="triton")``.
"""

from kernels.config_cache import ConfigCache
from kernels.config_select import ConfigSelector, Selection
from kernels.forward import layer_shape, moe_forward
from kernels.model_shape import LayerShape
from kernels.reference import moe_forward_reference
from kernels.routing import route
from kernels.types import (
    Activation,
    LoRAContext,
    LoRASlots,
    MoELayerWeights,
    RouterKind,
    RouterSpec,
    Routing,
    SharedExpertWeights,
    validate_forward_inputs,
    validate_layer,
)

__all__ = [
    "Activation",
    "ConfigCache",
    "ConfigSelector",
    "LayerShape",
    "LoRAContext",
    "LoRASlots",
    "MoELayerWeights",
    "RouterKind",
    "RouterSpec",
    "Routing",
    "Selection",
    "SharedExpertWeights",
    "layer_shape",
    "moe_forward",
    "moe_forward_reference",
    "route",
    "validate_forward_inputs",
    "validate_layer",
]
