"""Where tiny (or real-shaped) random base checkpoints and PEFT adapters are written.

The project's own tooling for demos, benchmarks and tests, with no transformers or peft at run
time. The output is laid out exactly as transformers 5.23 ``save_pretrained`` and peft 0.21
``save_pretrained`` write it (tests load both with transformers / PEFT to prove it):

* ``write_base_checkpoint``: config.json + model.safetensors (or shards + index) holding the
  MoE layers' router, experts and shared experts. The other tensors (attention, embeddings,
  norms, dense MLPs) are left out: the executor never reads them, and transformers initialises
  them randomly if asked to load the folder.
* ``write_adapter``: adapter_config.json + adapter_model.safetensors, in the 3D
  ``target_parameters`` format or the 2D per-expert format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.fp8 import quantize
from moelora.client.model_spec import (
    INDEX_FILE,
    SINGLE_FILE,
    ExpertLayout,
    ModelSpec,
    expected_shapes,
    layer_tensors,
    read_model_spec,
    scale_name,
    spec_from_config,
)
from moelora.client.model_types import MODEL_TYPES, ModelType, MoELayerRule
from shared.adapter_format import (
    CONFIG_FILE,
    KEY_PREFIX,
    WEIGHTS_FILE,
    AdapterFormat,
    read_lora_settings,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: config.json's quantization_config of DeepSeek-V3 (and of Qwen3's "-FP8" checkpoints).
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


@dataclass(frozen=True)
class SyntheticBase:
    """The shape and routing of a synthetic base model."""

    model_type: str
    hidden_size: int = 64
    moe_intermediate_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_layers: int = 2
    #: Dense (non-MoE) decoder layers: qwen's mlp_only_layers; for deepseek_v3 a prefix
    #: 0..k-1 (first_k_dense_replace). Other types have none.
    dense_layers: tuple[int, ...] = ()
    #: qwen2_moe: the shared expert's width; deepseek_v3: a multiple of moe_intermediate_size
    #: (n_shared_experts). 0 = none (qwen2_moe and deepseek_v3 always have one in practice).
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def config(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json as transformers 5.23 writes it (the fields that matter here)."""
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unknown model type {self.model_type!r}")
        kind = MODEL_TYPES[self.model_type]
        config: dict[str, Any] = {
            "architectures": [kind.architecture],
            "model_type": kind.name,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "vocab_size": 32,
            "max_position_embeddings": 64,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "dtype": _DTYPE_NAMES[dtype],
            "transformers_version": "5.23.0",
            kind.experts_key: self.num_experts,
            "num_experts_per_tok": self.top_k,
            kind.intermediate_key: self.moe_intermediate_size,
            **kind.extra_config,
        }
        if kind.intermediate_key != "intermediate_size":  # the dense layers' width
            config["intermediate_size"] = 2 * self.moe_intermediate_size
        if kind.moe_layers is MoELayerRule.SPARSE_STEP:
            config |= {"decoder_sparse_step": 1, "mlp_only_layers": list(self.dense_layers)}
        elif kind.moe_layers is MoELayerRule.FIRST_K_DENSE:
            if self.dense_layers != tuple(range(len(self.dense_layers))):
                raise ValueError(f"{kind.name}'s dense layers must be a prefix 0..k-1")
            config["first_k_dense_replace"] = len(self.dense_layers)
        elif self.dense_layers:
            raise ValueError(f"{kind.name} has no dense layers")
        config |= self._shared_expert_config(kind)
        if kind.grouped_routing:
            config |= {
                "n_group": self.n_group,
                "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor,
            }
        if not kind.always_renormalize:
            config["norm_topk_prob"] = self.norm_topk_prob
        if kind.layer_types:
            config["layer_types"] = ["full_attention"] * self.num_layers
        return config

    def _shared_expert_config(self, kind: ModelType) -> dict[str, Any]:
        shared = kind.shared_expert
        if shared is None:
            if self.shared_expert_intermediate_size:
                raise ValueError(f"{kind.name} has no shared expert")
            return {}
        if not shared.width_is_count:
            return {shared.width_key: self.shared_expert_intermediate_size}
        count, rest = divmod(self.shared_expert_intermediate_size, self.moe_intermediate_size)
        if rest:
            raise ValueError(f"{kind.name}'s shared width must be a multiple of the expert's")
        return {shared.width_key: count}


@dataclass(frozen=True)
class SyntheticAdapter:
    """What a synthetic PEFT adapter adapts, and how."""

    rank: int = 8
    alpha: float = 16.0
    use_rslora: bool = False
    #: Packed parameters to adapt: a non-empty subset of ("gate_up_proj", "down_proj"). In the
    #: 2D format gate_up_proj means gate_proj and up_proj (mixtral: w1 and w3).
    targets: tuple[str, ...] = ("gate_up_proj", "down_proj")
    format: AdapterFormat = AdapterFormat.TARGET_PARAMETERS
    #: MoE layers to adapt; None = all.
    layers: tuple[int, ...] | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)


def write_base_checkpoint(
    folder: Path,
    base: SyntheticBase,
    *,
    dtype: torch.dtype = torch.bfloat16,
    layout: ExpertLayout | None = None,
    seed: int = 0,
    shard_bytes: int | None = None,
    fp8: bool = False,
) -> ModelSpec:
    """Write a random checkpoint of ``base`` into ``folder``; returns its spec as read back.

    ``layout`` defaults to what transformers writes (per expert; gpt_oss fused-transposed);
    ``ExpertLayout.FUSED`` writes transformers' in-memory layout instead. ``shard_bytes``
    splits the tensors into shards with a model.safetensors.index.json. ``fp8`` stores the
    routed and shared experts' projections as DeepSeek-V3 and Qwen3-FP8 do: F8_E4M3 with a
    float32 ``weight_scale_inv`` per 128×128 block, and a ``quantization_config`` in config.json
    (the other tensors in ``dtype``).
    """
    config = base.config(dtype)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    draft = spec_from_config(
        config, config_json="", checkpoint_dtype=_DTYPE_NAMES[dtype], fingerprint=""
    )
    if layout is None:
        layout = draft.type.saved_layout
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in draft.moe_layers:
        names = layer_tensors(draft, layer, layout)
        quantized = set(names.projection_tensors) if fp8 else set()
        for name, shape in expected_shapes(draft, names).items():
            transposed = layout is ExpertLayout.FUSED_TRANSPOSED
            weight = _random_weight(name, shape, transposed, generator)
            if name in quantized:
                tensors[name], tensors[scale_name(name)] = quantize(weight)
            else:
                tensors[name] = weight.to(dtype)
        if names.score_correction_bias is not None:
            # transformers keeps this buffer in float32 whatever the model dtype.
            tensors[names.score_correction_bias] = tensors[names.score_correction_bias].float()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _save_shards(folder, tensors, shard_bytes)
    return read_model_spec(folder)


def quantize_checkpoint(folder: Path) -> ModelSpec:
    """Rewrite the checkpoint in ``folder`` (per-expert layout) as a block-scaled FP8 one, as
    ``write_base_checkpoint(..., fp8=True)`` writes it: the experts' projections become
    F8_E4M3 with their ``weight_scale_inv``, config.json gains the quantization_config."""
    spec = read_model_spec(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    quantized: set[str] = set()
    for layer in spec.moe_layers:
        quantized |= set(layer_tensors(spec, layer, ExpertLayout.PER_EXPERT).projection_tensors)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as stored:
            for name in stored.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[name] = stored.get_tensor(name)
        path.unlink()
    (folder / INDEX_FILE).unlink(missing_ok=True)
    for name in quantized:
        tensors[name], tensors[scale_name(name)] = quantize(tensors[name])
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _save_shards(folder, tensors, None)
    return read_model_spec(folder)


def write_adapter(
    folder: Path,
    spec: ModelSpec,
    adapter: SyntheticAdapter = SyntheticAdapter(),
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write a random PEFT LoRA adapter for ``spec`` into ``folder``; returns ``folder``.

    A is drawn with std 1/sqrt(in) and B with std 1/sqrt(r), so that each adapted projection
    changes by about as much as its base weights (std ~1/sqrt(in)) times the scaling.
    """
    targets = set(adapter.targets)
    if not targets or not targets <= {"gate_up_proj", "down_proj"}:
        raise ValueError(
            f"targets must be a non-empty subset of gate_up_proj, down_proj: {targets}"
        )
    layers = spec.moe_layers if adapter.layers is None else adapter.layers
    names_2d = spec.type.projections
    packed_into = ("gate_up_proj", "gate_up_proj", "down_proj")
    modules = [m for m, t in zip(names_2d, packed_into, strict=True) if t in targets]
    config = _adapter_config(adapter, sorted(targets), modules)
    settings = read_lora_settings(config)
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def add_pair(stem: str, module_key: str, experts: int, fan_in: int, fan_out: int) -> None:
        rank, _ = settings.rank_alpha(module_key)
        a = torch.randn(rank * experts, fan_in, generator=generator) / math.sqrt(fan_in)
        b = torch.randn(fan_out, rank * experts, generator=generator) / math.sqrt(rank)
        tensors[f"{KEY_PREFIX}{stem}.lora_A.weight"] = a.to(dtype)
        tensors[f"{KEY_PREFIX}{stem}.lora_B.weight"] = b.to(dtype)

    for layer in layers:
        if adapter.format is AdapterFormat.TARGET_PARAMETERS:
            experts = f"model.layers.{layer}.mlp.experts"
            # PEFT wraps gate_up_proj (registered first) innermost: it becomes base_layer.
            both = len(targets) == 2
            if "gate_up_proj" in targets:
                stem = f"{experts}.base_layer" if both else experts
                add_pair(stem, f"{experts}.gate_up_proj", e, h, 2 * i)
            if "down_proj" in targets:
                add_pair(experts, f"{experts}.down_proj", e, i, h)
        else:
            if not spec.type.peft_2d_modules:
                raise ValueError(f"PEFT has no 2D adapter format for {spec.model_type}")
            path = spec.type.peft_2d_modules[0]
            for expert in range(e):
                for module in modules:
                    stem = f"model.layers.{layer}.{path}.experts.{expert}.{module}"
                    fan_in, fan_out = (i, h) if module == names_2d[2] else (h, i)
                    add_pair(stem, stem, 1, fan_in, fan_out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    return folder


def _adapter_config(
    adapter: SyntheticAdapter, target_parameters: Sequence[str], modules: Sequence[str]
) -> dict[str, Any]:
    """adapter_config.json with the fields peft 0.21 writes for a LoRA adapter."""
    three_d = adapter.format is AdapterFormat.TARGET_PARAMETERS
    return {
        "alpha_pattern": dict(adapter.alpha_pattern),
        "auto_mapping": None,
        "base_model_name_or_path": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": adapter.alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "peft_version": "0.21.2",
        "r": adapter.rank,
        "rank_pattern": dict(adapter.rank_pattern),
        "revision": None,
        "target_modules": [] if three_d else list(modules),
        "target_parameters": list(target_parameters) if three_d else None,
        "task_type": None,
        "use_dora": False,
        "use_rslora": adapter.use_rslora,
    }


def _random_weight(
    name: str, shape: tuple[int, ...], transposed: bool, generator: torch.Generator
) -> torch.Tensor:
    """Weights with std 1/sqrt(fan_in) (biases 0.1), so activations stay O(1).

    ``transposed``: 3-D expert weights are stored (E, in, out) (gpt_oss), not (E, out, in).
    """
    if len(shape) == 1 or name.endswith("_bias"):
        return 0.1 * torch.randn(shape, generator=generator)
    fan_in = shape[-2] if transposed and len(shape) == 3 else shape[-1]
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def _save_shards(
    folder: Path, tensors: Mapping[str, torch.Tensor], shard_bytes: int | None
) -> None:
    if shard_bytes is None:
        save_file(dict(tensors), folder / SINGLE_FILE, metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file_name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file_name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
