"""``route`` against the routers of transformers 5.x themselves (same ids, same weights)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from kernels.routing import route
from kernels.synthetic import random_hidden, random_layer
from kernels.types import MoELayerWeights, RouterKind, RouterSpec

transformers = pytest.importorskip("transformers")

E, H, T = 16, 32, 40


# model type → (config class, router class, config name of the expert count)
_HF_ROUTERS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeTopKRouter", "num_experts"),
    "mixtral": ("MixtralConfig", "MixtralTopKRouter", "num_local_experts"),
    "gpt_oss": ("GptOssConfig", "GptOssTopKRouter", "num_local_experts"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3TopkRouter", "n_routed_experts"),
}


def _hf_router(kind: str, layer: MoELayerWeights, **config: Any) -> Any:
    """The transformers router module of ``kind``, loaded with ``layer``'s router tensors."""
    config_name, router_name, experts_name = _HF_ROUTERS[kind]
    modeling: Any = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    cfg = getattr(transformers, config_name)(
        hidden_size=H,
        num_experts_per_tok=layer.router.top_k,
        **{experts_name: E},
        **config,
    )
    module = getattr(modeling, router_name)(cfg)
    state = {"weight": layer.router_weight}
    if layer.router_bias is not None:
        state["bias"] = layer.router_bias
    if layer.e_score_correction_bias is not None:
        state["e_score_correction_bias"] = layer.e_score_correction_bias
    module.load_state_dict(state)
    return module.to(layer.router_weight.dtype)


CASES = [
    ("qwen3_moe", RouterSpec(RouterKind.SOFTMAX_TOPK, 4, True), {"norm_topk_prob": True}),
    ("qwen3_moe", RouterSpec(RouterKind.SOFTMAX_TOPK, 4, False), {"norm_topk_prob": False}),
    ("qwen3_moe", RouterSpec(RouterKind.SOFTMAX_TOPK, 1, False), {"norm_topk_prob": False}),
    ("mixtral", RouterSpec(RouterKind.SOFTMAX_TOPK, 2, True), {}),
    ("gpt_oss", RouterSpec(RouterKind.TOPK_SOFTMAX, 4, True), {}),
    (
        "deepseek_v3",
        RouterSpec(RouterKind.SIGMOID_GROUPED_TOPK, 6, True, 4, 2, 2.5),
        {"n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    ),
    (
        "deepseek_v3",
        RouterSpec(RouterKind.SIGMOID_GROUPED_TOPK, 3, False, 8, 3, 1.0),
        {"n_group": 8, "topk_group": 3, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    ),
]


@pytest.mark.parametrize(("kind", "spec", "config"), CASES, ids=lambda c: getattr(c, "value", c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_transformers(
    kind: str, spec: RouterSpec, config: dict[str, Any], dtype: torch.dtype
) -> None:
    layer = random_layer(E, H, 8, spec.top_k, dtype=dtype, router=spec, seed=5)
    hidden = random_hidden(T, H, dtype=dtype, seed=6)
    routing = route(hidden, layer)
    with torch.no_grad():
        _, hf_weights, hf_ids = _hf_router(kind, layer, **config)(hidden)
    # Order within the k may differ (deepseek's top-k is unsorted): compare per token sorted.
    ids, order = routing.topk_ids.long().sort(dim=-1)
    hf_ids_sorted, hf_order = hf_ids.long().sort(dim=-1)
    assert torch.equal(ids, hf_ids_sorted)
    assert routing.topk_ids.dtype == torch.int32
    assert routing.topk_weights.dtype == torch.float32
    weights = routing.topk_weights.gather(1, order)
    hf_weights = hf_weights.float().gather(1, hf_order)
    # transformers rounds the weights to the model dtype (we keep float32).
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(weights, hf_weights, rtol=tol, atol=tol)
