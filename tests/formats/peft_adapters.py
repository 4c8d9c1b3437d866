"""LoRA adapters made by PEFT itself on the tiny transformers models: the independent reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from moelora.client.model_types import MODEL_TYPES
from tests.formats.hf_models import build_model

#: Adapter variants the parity tests cover, as LoraConfig arguments.
VARIANTS: dict[str, dict[str, Any]] = {
    "both": {"target_parameters": ["gate_up_proj", "down_proj"], "r": 4, "lora_alpha": 8},
    "down_only": {"target_parameters": ["down_proj"], "r": 3, "lora_alpha": 5},
    "gate_up_only": {"target_parameters": ["gate_up_proj"], "r": 2, "lora_alpha": 3},
    "rslora": {
        "target_parameters": ["gate_up_proj", "down_proj"],
        "r": 4,
        "lora_alpha": 6,
        "use_rslora": True,
    },
    "patterns": {
        "target_parameters": ["gate_up_proj", "down_proj"],
        "r": 4,
        "lora_alpha": 8,
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {r".*\.gate_up_proj": 3},
    },
    # transformers-4-style module names: PEFT rewrites them to target_parameters with
    # rank_pattern / alpha_pattern for the fused gate_up_proj.
    "target_modules": {
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "r": 3,
        "lora_alpha": 6,
    },
}


def make_peft_adapter(
    model_type: str, variant: str, folder: Path, seed: int = 0
) -> tuple[PeftModel, Path]:
    """A fresh tiny model with a random LoRA of ``variant`` (B non-zero), saved to ``folder``."""
    model = build_model(model_type)
    kwargs = dict(VARIANTS[variant])
    if "target_modules" in kwargs:  # the per-expert module names of this type
        kwargs["target_modules"] = list(MODEL_TYPES[model_type].projections)
    kwargs.setdefault("target_modules", [])
    peft_model = get_peft_model(model, LoraConfig(**kwargs))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(str(folder))
    return peft_model, folder


def load_peft_adapter(model_type: str, folder: Path) -> PeftModel:
    """PEFT's own loading of an adapter folder onto the tiny model of ``model_type``."""
    peft_model: PeftModel = PeftModel.from_pretrained(build_model(model_type), folder)
    return peft_model
