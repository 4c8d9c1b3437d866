"""Random layers, adapters and routings for the tests, the tuner and the benchmark.

Scales keep every term of the math O(1) (weights ~ 1/sqrt(fan-in)), so relative errors mean
something; the LoRA deltas are made large enough to matter (a kernel that drops them fails).
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.fp8 import quantize
from kernels.types import (
    Activation,
    LoRAContext,
    LoRASlots,
    MoELayerWeights,
    RouterKind,
    RouterSpec,
    Routing,
    SharedExpertWeights,
)


def _randn(
    shape: tuple[int, ...],
    scale: float,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator,
) -> torch.Tensor:
    # Drawn in float32 on the target device (fast for GPU-sized layers), scaled in place (a
    # DeepSeek-V3 w13 is 28 GiB of float32: a second copy would not fit an 80 GB GPU), then
    # rounded.
    values = torch.randn(shape, generator=generator, device=device).mul_(scale)
    return values.to(dtype)


def random_layer(
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    router: RouterSpec | None = None,
    activation: Activation = Activation.SILU,
    biases: bool = False,
    shared_inter: int = 0,
    shared_gate: bool = False,
) -> MoELayerWeights:
    """A layer with N(0, 1/fan-in) weights; ``router`` defaults to softmax→top-k→renormalise."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return _randn(shape, scale, dtype, device, g)

    router = router or RouterSpec(RouterKind.SOFTMAX_TOPK, top_k=top_k, renormalize=True)
    shared = None
    if shared_inter:
        shared = SharedExpertWeights(
            w13=randn(2 * shared_inter, hidden, scale=hidden**-0.5),
            w2=randn(hidden, shared_inter, scale=shared_inter**-0.5),
            gate=randn(1, hidden, scale=hidden**-0.5) if shared_gate else None,
        )
    grouped = router.kind is RouterKind.SIGMOID_GROUPED_TOPK
    biased_router = router.kind is RouterKind.TOPK_SOFTMAX
    return MoELayerWeights(
        router=router,
        router_weight=randn(num_experts, hidden, scale=hidden**-0.5),
        w13=randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
        w2=randn(num_experts, hidden, inter, scale=inter**-0.5),
        activation=activation,
        router_bias=randn(num_experts, scale=0.5) if biased_router else None,
        e_score_correction_bias=randn(num_experts, scale=0.1) if grouped else None,
        b13=randn(num_experts, 2 * inter, scale=0.5) if biases else None,
        b2=randn(num_experts, hidden, scale=0.5) if biases else None,
        shared=shared,
    )


def fp8_layer(layer: MoELayerWeights) -> MoELayerWeights:
    """``layer`` with its routed experts quantised to FP8 (``kernels.fp8.quantize``); the rest
    (router, biases, shared expert) stays in its dtype, which becomes the compute dtype."""
    w13, w13_scale = _quantize_per_expert(layer.w13)
    w2, w2_scale = _quantize_per_expert(layer.w2)
    return dataclasses.replace(layer, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)


def _quantize_per_expert(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` one expert at a time: its float32 temporaries stay one expert's size
    (DeepSeek-V3's whole w13 would need 30 GB of them)."""
    parts = [quantize(expert) for expert in weight]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def random_slots(
    layer: MoELayerWeights,
    num_slots: int,
    rank: int,
    *,
    seed: int = 1,
    enabled: list[bool] | None = None,
    delta_scale: float = 0.5,
) -> LoRASlots:
    """Slot buffers for ``layer`` (its dtype and device); the delta B·A has norm ~delta_scale
    relative to the base weight's. All slots are enabled unless ``enabled`` says otherwise."""
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    dtype, device = layer.dtype, layer.w13.device
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return _randn(shape, scale, dtype, device, g)

    flags = enabled if enabled is not None else [True] * num_slots
    b_scale = delta_scale * rank**-0.5
    return LoRASlots(
        a13=randn(num_slots, e, rank, h, scale=h**-0.5),
        b13=randn(num_slots, e, 2 * i, rank, scale=b_scale),
        a2=randn(num_slots, e, rank, i, scale=i**-0.5),
        b2=randn(num_slots, e, h, rank, scale=b_scale),
        enabled=torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device),
    )


def round_robin_slots(
    num_tokens: int, num_adapters: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Token t uses slot t % num_adapters (the benchmark's assignment); (T,) int32."""
    return (torch.arange(num_tokens, device=device) % num_adapters).to(torch.int32)


def random_token_slots(
    num_tokens: int, num_slots: int, *, seed: int = 2, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Each token a uniformly random slot or -1 (no adapter); (T,) int32."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    return slots.to(device)


def random_hidden(
    num_tokens: int,
    hidden: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 3,
) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return _randn((num_tokens, hidden), 1.0, dtype, device, g)


def random_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int = 4,
    device: torch.device | str = "cpu",
) -> Routing:
    """The benchmark's routing: random logits → softmax → top-k → renormalise."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids.to(device=device, dtype=torch.int32), weights.to(device).float())


def lora_context(slots: LoRASlots, token_slots: torch.Tensor) -> LoRAContext:
    return LoRAContext(slots=slots, token_slots=token_slots.to(slots.a13.device))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; NaN anywhere gives NaN (never passes)."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp(min=1e-30))


def worst_row_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max over rows of ‖actual_row − expected_row‖ / ‖expected_row‖ in float64 (NaN anywhere
    gives NaN): a lost or shifted row shows, where one norm over a long output hides it."""
    a, e = actual.double().flatten(1), expected.double().flatten(1)
    rows = (a - e).norm(dim=1) / e.norm(dim=1).clamp(min=1e-30)
    return float(rows.max()) if rows.numel() else 0.0
