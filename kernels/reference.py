"""The MoE + multi-LoRA math written plainly in torch: the oracle and the CPU fallback.

For a token x routed to experts e_1..e_k with weights w_1..w_k, whose adapter sits in slot s
(or which has none):

    g_u = W13[e] x (+ b13[e]) + B13[s,e] (A13[s,e] x)
    a   = act(g_u)
    y_e = W2[e] a (+ b2[e]) + B2[s,e] (A2[s,e] a)
    out = Σ_j w_j y_{e_j}  (+ shared expert)

Everything is computed in ``compute_dtype`` (float32, or float64 for checking the checkers),
FP8 experts with their weights dequantised into it (``kernels.fp8.dequantize``), and the
result is returned in the hidden states' dtype. The loops run over experts and, inside, over
the adapter slots present; token rows are gathered with index ops, so the cost is that of a
per-expert GEMM loop and it is usable on the CPU at serving sizes. The GEMMs go through
``kernels.row_blocks`` so that a token's result never depends on the other tokens of the batch
(the executor merges requests and must answer each as if it ran alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize
from kernels.fp8_activations import dequantize_activations, quantize_activations_reference
from kernels.routing import route
from kernels.row_blocks import linear
from kernels.shared_expert import shared_expert_forward
from kernels.types import (
    Activation,
    LoRAContext,
    MoELayerWeights,
    Routing,
    validate_forward_inputs,
)


def activate(
    gate_up: torch.Tensor, activation: Activation, alpha: float, limit: float
) -> torch.Tensor:
    """(n, 2I) rows ``[gate | up]`` → (n, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation is Activation.SILU:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def effective_token_slots(lora: LoRAContext) -> torch.Tensor:
    """(T,) slot of each token's adapter, -1 where it has none or its slot is disabled."""
    slots = lora.token_slots.long()
    enabled = lora.slots.enabled[slots.clamp(min=0)] != 0
    return torch.where((slots >= 0) & enabled, slots, -1)


def _add_lora(
    out: torch.Tensor,
    inputs: torch.Tensor,
    row_slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
) -> None:
    """out[rows of slot s] += (inputs[rows] @ A[s]ᵀ) @ B[s]ᵀ for every slot s present.

    lora_a: (S, R, in), lora_b: (S, out, R) for one expert; row_slots: (n,) with -1 = none.
    """
    for slot in torch.unique(row_slots).tolist():
        if slot < 0:
            continue
        rows = row_slots == slot
        shrunk = linear(inputs[rows], lora_a[slot].to(inputs.dtype))
        out[rows] += linear(shrunk, lora_b[slot].to(inputs.dtype))


def _expert_weights(
    layer: MoELayerWeights, expert: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W13[e], W2[e]) of one expert in ``dtype``, dequantised where they are FP8."""
    if layer.w13_scale is not None and layer.w2_scale is not None:
        return (
            dequantize(layer.w13[expert], layer.w13_scale[expert], dtype),
            dequantize(layer.w2[expert], layer.w2_scale[expert], dtype),
        )
    return layer.w13[expert].to(dtype), layer.w2[expert].to(dtype)


def _expert_input(x: torch.Tensor, dtype: torch.dtype, fp8_activations: bool) -> torch.Tensor:
    """An expert GEMM's input: x, or with FP8 activations x rounded to ``dtype`` (as the
    kernels store it), quantised and dequantised."""
    if not fp8_activations:
        return x
    q, scale = quantize_activations_reference(x.to(dtype))
    return dequantize_activations(q, scale, x.dtype)


def moe_forward_reference(
    hidden: torch.Tensor,
    layer: MoELayerWeights,
    lora: LoRAContext | None = None,
    routing: Routing | None = None,
    compute_dtype: torch.dtype = torch.float32,
    fp8_activations: bool | None = None,
) -> torch.Tensor:
    """One MoE layer for ``hidden`` (T, H); returns (T, H) in hidden's dtype.

    ``routing`` defaults to ``route(hidden, layer)``; ``lora`` None means no adapters.
    ``fp8_activations`` (FP8 experts; default: the layer's ``fp8_activations``): the experts'
    GEMMs take their inputs quantised as the W8A8 kernels do (``kernels.fp8_activations``: x,
    and the activation after rounding to hidden's dtype); the LoRA takes them unquantised.
    """
    validate_forward_inputs(hidden, layer, lora, routing)
    if fp8_activations is None:
        fp8_activations = layer.fp8_activations
    if routing is None:
        routing = route(hidden, layer)
    x = hidden.to(compute_dtype)
    out = torch.zeros_like(x)
    slots = None if lora is None else lora.slots
    token_slots = None if lora is None else effective_token_slots(lora)
    for expert in torch.unique(routing.topk_ids).tolist():
        tokens, position = torch.nonzero(routing.topk_ids == expert, as_tuple=True)
        xe = x[tokens]
        w13, w2 = _expert_weights(layer, expert, compute_dtype)
        gate_up = linear(_expert_input(xe, hidden.dtype, fp8_activations), w13)
        if layer.b13 is not None:
            gate_up += layer.b13[expert].to(compute_dtype)
        row_slots = None if token_slots is None else token_slots[tokens]
        if slots is not None and row_slots is not None:
            _add_lora(gate_up, xe, row_slots, slots.a13[:, expert], slots.b13[:, expert])
        a = activate(gate_up, layer.activation, layer.swiglu_alpha, layer.swiglu_limit)
        y = linear(_expert_input(a, hidden.dtype, fp8_activations), w2)
        if layer.b2 is not None:
            y += layer.b2[expert].to(compute_dtype)
        if slots is not None and row_slots is not None:
            _add_lora(y, a, row_slots, slots.a2[:, expert], slots.b2[:, expert])
        weights = routing.topk_weights[tokens, position].to(compute_dtype)
        out.index_add_(0, tokens, y * weights[:, None])
    if layer.shared is not None:
        out += shared_expert_forward(hidden, layer.shared, compute_dtype)
    return out.to(hidden.dtype)
