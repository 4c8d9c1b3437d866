"""Fused MoE + multi-LoRA forward: Triton kernels, a torch reference, tuned configs, a benchmark."""

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
    "validate_forward_inputs",
]
