"""Fused MoE + multi-LoRA forward: Triton kernels, a torch reference, tuned configs, a benchmark.

Entry point: ``moe_forward(hidden, layer, lora=None, routing=None, *, backend="triton")``.
"""

from kernels.forward import moe_forward
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
)

__all__ = [
    "Activation",
    "LoRAContext",
    "LoRASlots",
    "MoELayerWeights",
    "RouterKind",
    "RouterSpec",
    "Routing",
    "SharedExpertWeights",
    "moe_forward",
    "moe_forward_reference",
    "route",
    "validate_forward_inputs",
]
