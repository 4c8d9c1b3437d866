"""The oracle checked against an independent per-token float64 loop, on tiny cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import moe_forward_reference
from kernels.synthetic import (
    lora_context,
    random_hidden,
    random_layer,
    random_routing,
    random_slots,
    random_token_slots,
)
from kernels.types import Activation, LoRAContext, MoELayerWeights, Routing


def per_token_loop(
    hidden: torch.Tensor, layer: MoELayerWeights, lora: LoRAContext | None, routing: Routing
) -> torch.Tensor:
    """The design document's formulas, token by token, expert by expert, in float64."""
    d = torch.float64
    out = torch.zeros(hidden.shape, dtype=d)
    for t in range(hidden.shape[0]):
        x = hidden[t].to(d)
        slot = -1 if lora is None else int(lora.token_slots[t])
        if slot >= 0 and lora is not None and not int(lora.slots.enabled[slot]):
            slot = -1
        for j in range(routing.topk_ids.shape[1]):
            e = int(routing.topk_ids[t, j])
            g_u = layer.w13[e].to(d) @ x
            if layer.b13 is not None:
                g_u = g_u + layer.b13[e].to(d)
            if slot >= 0 and lora is not None:
                s = lora.slots
                g_u = g_u + s.b13[slot, e].to(d) @ (s.a13[slot, e].to(d) @ x)
            i = layer.intermediate_size
            gate, up = g_u[:i], g_u[i:]
            if layer.activation is Activation.SILU:
                a = gate / (1 + torch.exp(-gate)) * up
            else:
                lim, alpha = layer.swiglu_limit, layer.swiglu_alpha
                gate = torch.minimum(gate, torch.tensor(lim, dtype=d))
                up = up.clamp(-lim, lim)
                a = (up + 1) * gate / (1 + torch.exp(-alpha * gate))
            y = layer.w2[e].to(d) @ a
            if layer.b2 is not None:
                y = y + layer.b2[e].to(d)
            if slot >= 0 and lora is not None:
                s = lora.slots
                y = y + s.b2[slot, e].to(d) @ (s.a2[slot, e].to(d) @ a)
            out[t] += float(routing.topk_weights[t, j]) * y
        if layer.shared is not None:
            sh = layer.shared
            g_u = sh.w13.to(d) @ x
            half = g_u.shape[0] // 2
            y = sh.w2.to(d) @ (F.silu(g_u[:half]) * g_u[half:])
            if sh.gate is not None:
                y = y * torch.sigmoid(sh.gate.to(d) @ x)
            out[t] += y
    return out


@pytest.mark.parametrize(
    ("activation", "biases", "shared_inter", "shared_gate"),
    [
        (Activation.SILU, False, 0, False),
        (Activation.GPT_OSS, True, 0, False),
        (Activation.SILU, False, 24, True),
        (Activation.SILU, True, 16, False),
    ],
)
@pytest.mark.parametrize("with_lora", [False, True])
def test_reference_matches_per_token_loop(
    activation: Activation, biases: bool, shared_inter: int, shared_gate: bool, with_lora: bool
) -> None:
    t, e, h, i, k = 9, 5, 16, 12, 2
    layer = random_layer(
        e, h, i, k, dtype=torch.float32, activation=activation, biases=biases,
        shared_inter=shared_inter, shared_gate=shared_gate, seed=11,
    )  # fmt: skip
    # Large activations so that gpt_oss's clamps are exercised.
    hidden = random_hidden(t, h, dtype=torch.float32) * 4
    routing = random_routing(t, e, k)
    lora = None
    if with_lora:
        slots = random_slots(layer, 3, 4, enabled=[True, False, True])
        lora = lora_context(slots, random_token_slots(t, 3))
    expected = per_token_loop(hidden, layer, lora, routing)
    got64 = moe_forward_reference(hidden, layer, lora, routing, compute_dtype=torch.float64)
    got32 = moe_forward_reference(hidden, layer, lora, routing)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got64.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got32.double(), expected, rtol=1e-4, atol=1e-4)


def test_reference_returns_hidden_dtype_and_routes_itself() -> None:
    layer = random_layer(4, 16, 8, 2, dtype=torch.bfloat16)
    hidden = random_hidden(3, 16, dtype=torch.bfloat16)
    out = moe_forward_reference(hidden, layer)
    assert out.dtype == torch.bfloat16
    assert out.shape == hidden.shape
