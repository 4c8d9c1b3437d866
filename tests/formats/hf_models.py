"""Tiny random MoE models built and saved by transformers itself: the independent reference.

Shapes are chosen so no two of H, I and 2I coincide (H=48, I=16, 2I=32): then a LoRA tensor
of the wrong projection cannot pass for the right one by accident.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from moelora.client.model_types import MODEL_TYPES as MODEL_TYPES_TABLE
from moelora.client.model_types import SUPPORTED_MODEL_TYPES

HIDDEN = 48
INTERMEDIATE = 16
MODEL_TYPES = SUPPORTED_MODEL_TYPES

_COMMON: dict[str, Any] = {
    "vocab_size": 32,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
}
#: Beyond the table's defaults: features some types exercise.
_FEATURES: dict[str, dict[str, Any]] = {
    # layer 1 dense: exercises mlp_only_layers
    "qwen3_moe": {"norm_topk_prob": True, "mlp_only_layers": [1]},
    "qwen2_moe": {"shared_expert_intermediate_size": 24},
    "olmoe": {"num_experts": 6},
    # layer 0 dense (first_k_dense_replace); 8 experts in 4 groups, 2 groups kept
    "deepseek_v3": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
    },
}


def model_config(model_type: str) -> dict[str, Any]:
    """The tiny model's config fields: 4 experts, top-2, from the table unless _FEATURES says."""
    kind = MODEL_TYPES_TABLE[model_type]
    config = _COMMON | {
        kind.experts_key: 4,
        "num_experts_per_tok": 2,
        kind.intermediate_key: INTERMEDIATE,
        **kind.extra_config,
    }
    if kind.intermediate_key != "intermediate_size":  # the dense layers' width (≠ H, I, 2I)
        config["intermediate_size"] = 40
    if kind.layer_types:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return config | _FEATURES.get(model_type, {})


def build_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny random float32 model of ``model_type`` with every weight non-trivial."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **(model_config(model_type) | overrides))
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32
    )
    torch.nn.Module.eval(model)  # PreTrainedModel.eval is untyped
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Biases and routers start at zero in some types; random values test their wiring.
            param.normal_(0.0, 0.5 if "router" in name or "gate." in name else 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def save_model(model: PreTrainedModel, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


def moe_block(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    """Decoder layer ``layer``'s MLP block of a causal LM (or of PEFT's wrapped model)."""
    return model.get_submodule(f"model.layers.{layer}.mlp")


def run_block(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The MoE block's output for hidden (T, H) (gpt_oss also returns router scores)."""
    with torch.no_grad():
        out = block(hidden.unsqueeze(0))
    if isinstance(out, tuple):
        out = out[0]
    result: torch.Tensor = out.squeeze(0)
    return result
