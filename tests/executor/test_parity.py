"""Forward over gRPC matches transformers' MoE block with the PEFT adapter active (and without
one for base segments), for each model type and adapter variant, alone and in mixed batches.

Every test runs on the CPU (torch reference) and, where CUDA is visible (``-m gpu``), on the
GPU through the Triton kernels in float32; ``test_bfloat16_on_the_gpu`` covers bf16 serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kernels.synthetic import relative_error
from tests.executor.conftest import QWEN_RECIPES, Placement, StartExecutor
from tests.executor.worlds import LEGACY_2D, TOKENS, Recipe, World, build_world

#: Per model type: a 3D adapter on both parameters, one on down_proj only, and a 2D legacy one
#: where PEFT can give the reference: not gpt_oss (its experts never were per-expert modules),
#: not qwen2_moe (PEFT 0.21 matches gate_proj/up_proj/down_proj on the shared expert and
#: silently drops the per-expert tensors); those get a third 3D adapter instead.
OTHER_TYPES = ("mixtral", "olmoe", "gpt_oss", "qwen2_moe", "deepseek_v3")
NO_PEFT_2D = ("gpt_oss", "qwen2_moe")
OTHER_RECIPES = [Recipe("both", "both", 11), Recipe("down", "down_only", 12)]

#: bf16 input, weights, slots and output against the float32 reference: ‖Δ‖/‖reference‖.
#: Each rounding is 2^-9 relative; several (input, W13, LoRA, activation, W2, output) add up to
#: about 1%; the kernels' own bf16 bound (2e-2, against a reference with the same bf16
#: weights) plus the weights' rounding.
GPU_BFLOAT16_RELATIVE = 3e-2


def test_every_qwen3_variant_and_base_match_peft(
    qwen_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    client = start_executor(qwen_world, num_slots=8, **placement.settings).client
    for layer in qwen_world.moe_layers:
        hidden = qwen_world.inputs[layer]
        base = client.forward(layer, hidden)
        assert base.resolved_adapters == [""]
        assert base.output.dtype == torch.float32
        placement.check(base.output, qwen_world.reference[(None, layer)])
        for recipe in QWEN_RECIPES:
            result = client.forward(layer, hidden, [(len(hidden), recipe.name)])
            assert result.resolved_adapters == [f"{recipe.name}:1"]
            placement.check(result.output, qwen_world.reference[(recipe.name, layer)])


def test_mixed_batch_matches_per_segment_references(
    qwen_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    client = start_executor(qwen_world, **placement.settings).client
    layer = qwen_world.moe_layers[-1]
    segments: list[tuple[int, str | None]] = [
        (3, "alpha"),
        (2, None),
        (4, "zeta"),
        (1, "alpha"),
        (2, "delta"),
    ]
    result = client.forward(layer, qwen_world.inputs[layer], segments)
    assert result.resolved_adapters == ["alpha:1", "", "zeta:1", "alpha:1", "delta:1"]
    placement.check(result.output, qwen_world.expected(layer, segments))
    assert result.server_time_us > 0


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_half_precision_on_the_wire_is_computed_in_float32_and_returned_in_kind(
    qwen_world: World, start_executor: StartExecutor, wire: torch.dtype
) -> None:
    """The executor computes in float32 here: a half-precision request must give exactly the
    float32 answer for the same (rounded) input, rounded once to the wire dtype. (Against
    the unrounded reference no tolerance holds: rounding the input can change the top-k.)"""
    client = start_executor(qwen_world).client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].to(wire)
    result = client.forward(layer, hidden, [(TOKENS, "gamma")])
    assert result.output.dtype == wire
    in_float32 = client.forward(layer, hidden.float(), [(TOKENS, "gamma")]).output
    torch.testing.assert_close(result.output, in_float32.to(wire), atol=0, rtol=0)


@pytest.fixture(scope="module", params=OTHER_TYPES)
def other_world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> World:
    model_type: str = request.param
    variant = "rslora" if model_type in NO_PEFT_2D else LEGACY_2D
    recipes = [*OTHER_RECIPES, Recipe("legacy", variant, 13)]
    return build_world(model_type, Path(tmp_path_factory.mktemp(model_type)), recipes)


def test_other_model_types_match_peft_in_one_mixed_batch(
    other_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    client = start_executor(other_world, **placement.settings).client
    for layer in other_world.moe_layers:
        hidden = other_world.inputs[layer]
        segments: list[tuple[int, str | None]] = [
            (4, "both"),
            (3, None),
            (3, "legacy"),
            (2, "down"),
        ]
        result = client.forward(layer, hidden, segments)
        placement.check(result.output, other_world.expected(layer, segments))


def _qwen3_routing(world: World, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qwen3_moe's routing in float64 from the checkpoint's router: softmax over all experts,
    top-k, renormalised (norm_topk_prob) — so that bf16 logits cannot pick other experts."""
    with safe_open(str(world.checkpoint / "model.safetensors"), "pt") as weights:
        router = weights.get_tensor(f"model.layers.{layer}.mlp.gate.weight").double()
    probs = torch.softmax(world.inputs[layer].double() @ router.T, dim=-1)
    top, ids = probs.topk(world.top_k, dim=-1)
    return ids.to(torch.int32), (top / top.sum(dim=-1, keepdim=True)).float()


def _experts_float64(
    world: World, layer: int, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Σ_j w_j · down_e(silu(gate_e x) · up_e x) in float64 from the checkpoint's tensors."""
    x = world.inputs[layer].double()
    out = torch.zeros_like(x)
    prefix = f"model.layers.{layer}.mlp.experts"
    with safe_open(str(world.checkpoint / "model.safetensors"), "pt") as tensors:
        for e in range(world.num_experts):
            gate, up, down = (
                tensors.get_tensor(f"{prefix}.{e}.{name}.weight").double()
                for name in ("gate_proj", "up_proj", "down_proj")
            )
            y = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
            weight = (weights.double() * (ids == e)).sum(dim=-1, keepdim=True)
            out += weight * y
    return out


def test_precomputed_routing_replaces_the_router(
    qwen_world: World, start_executor: StartExecutor, placement: Placement
) -> None:
    client = start_executor(qwen_world, **placement.settings).client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    # The router's own choice, given: the same as letting the router decide.
    routing = _qwen3_routing(qwen_world, layer)
    for name in (None, "alpha"):
        result = client.forward(layer, hidden, [(TOKENS, name)], routing=routing)
        placement.check(result.output, qwen_world.reference[(name, layer)])
    # Any other choice, int64 ids: checked against the experts computed in float64.
    tokens = torch.arange(TOKENS)
    ids = torch.stack([tokens % qwen_world.num_experts, (tokens + 1) % qwen_world.num_experts], 1)
    weights = torch.tensor([[0.75, 0.25]]).repeat(TOKENS, 1)
    result = client.forward(layer, hidden, routing=(ids, weights))
    placement.check(result.output, _experts_float64(qwen_world, layer, ids, weights).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_on_the_gpu(qwen_world: World, start_executor: StartExecutor) -> None:
    """Serving dtype bf16 (weights, slots, activations) through Triton, bf16 on the wire, the
    routing given; each segment within the bf16 tolerance of the float32 PEFT reference."""
    running = start_executor(qwen_world, device="cuda", dtype="bfloat16", num_slots=8)
    info = running.client.get_executor_info()
    assert info.backend == "triton" and info.device != "cpu"
    for layer in qwen_world.moe_layers:
        routing = _qwen3_routing(qwen_world, layer)
        hidden = qwen_world.inputs[layer].to(torch.bfloat16)
        for name in [None, *(recipe.name for recipe in QWEN_RECIPES)]:
            result = running.client.forward(layer, hidden, [(TOKENS, name)], routing=routing)
            assert result.output.dtype == torch.bfloat16
            error = relative_error(result.output, qwen_world.reference[(name, layer)])
            assert error < GPU_BFLOAT16_RELATIVE, f"{name} layer {layer}: {error:.2e}"
