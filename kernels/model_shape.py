"""The MoE layer shape (E, H, I, k) of a checkpoint, read from its config.json.

The kernels' configurations are keyed by this shape, so ``kernels.tune --model`` and
``kernels.bench --model`` read it here without the executor's model loader (``kernels``
imports nothing of the services). The keys per model type follow transformers' configs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: config.json key of the experts' intermediate size per model type.
_INTERMEDIATE_KEY = {
    "qwen2_moe": "moe_intermediate_size",
    "qwen3_moe": "moe_intermediate_size",
    "deepseek_v3": "moe_intermediate_size",
    "olmoe": "intermediate_size",
    "mixtral": "intermediate_size",
    "gpt_oss": "intermediate_size",
}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

MODEL_TYPES = tuple(_INTERMEDIATE_KEY)


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's expert shape: E experts of (2I, H) / (H, I), k experts per token;
    ``fp8``: the experts are FP8 with block scales (``MoELayerWeights.fp8``)."""

    experts: int
    hidden: int
    inter: int
    top_k: int
    name: str = ""
    fp8: bool = False

    @property
    def key(self) -> str:
        """The shape part of a configuration key (``kernels.configs.table_key`` adds r). FP8
        experts are keyed apart: their configurations differ (``kernels.configs.fit_stages``)."""
        key = f"E={self.experts},H={self.hidden},I={self.inter},k={self.top_k}"
        return key + ",weights=fp8" if self.fp8 else key

    @property
    def label(self) -> str:
        return self.name or self.key


def _integer(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def shape_from_config(config: Mapping[str, Any], name: str = "") -> LayerShape:
    """The layer shape a config.json describes; ValueError for an unsupported model type."""
    model_type = config.get("model_type")
    if model_type not in _INTERMEDIATE_KEY:
        raise ValueError(
            f"config.json model_type {model_type!r} is not one of " + ", ".join(MODEL_TYPES)
        )
    counts = [key for key in _EXPERT_COUNT_KEYS if key in config]
    if not counts:
        raise ValueError("config.json lacks " + " or ".join(_EXPERT_COUNT_KEYS))
    return LayerShape(
        experts=_integer(config, counts[0]),
        hidden=_integer(config, "hidden_size"),
        inter=_integer(config, _INTERMEDIATE_KEY[model_type]),
        top_k=_integer(config, "num_experts_per_tok"),
        name=name or str(config.get("_name_or_path") or model_type),
    )


def shape_from_checkpoint(path: Path) -> LayerShape:
    """The layer shape of a checkpoint folder (or of its config.json itself)."""
    config_file = path / "config.json" if path.is_dir() else path
    name = (path if path.is_dir() else path.parent).name
    return shape_from_config(json.loads(config_file.read_text()), name)
