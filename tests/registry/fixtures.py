"""Tiny checkpoints and PEFT adapters written with numpy + safetensors (no torch):
a qwen3_moe base model (H=16, I=8, E=4, k=2, 2 MoE layers) and 3D
``target_parameters`` adapters for it, plus helpers that break them; and ``Collect``, a sink for
``UrlRangeReader``."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from shared.url_ranges import STEP_BYTES


@dataclass(frozen=True)
class TinyShape:
    hidden: int = 16
    inter: int = 8
    experts: int = 4
    top_k: int = 2
    layers: int = 2


SHAPE = TinyShape()


def write_base_model(folder: Path, shape: TinyShape = SHAPE, seed: int = 0) -> Path:
    """A qwen3_moe checkpoint folder: config.json + model.safetensors (MoE tensors only)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": shape.hidden,
        "intermediate_size": 4 * shape.hidden,
        "moe_intermediate_size": shape.inter,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    tensors = {}
    h, i, e = shape.hidden, shape.inter, shape.experts
    for layer in range(shape.layers):
        mlp = f"model.layers.{layer}.mlp"
        tensors[f"{mlp}.gate.weight"] = rng.standard_normal((e, h), dtype=np.float32)
        for expert in range(e):
            for proj, dims in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                tensors[f"{mlp}.experts.{expert}.{proj}.weight"] = rng.standard_normal(
                    dims, dtype=np.float32
                )
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def adapter_tensors(
    shape: TinyShape = SHAPE,
    rank: int = 4,
    layers: tuple[int, ...] = (0, 1),
    dtype: type[np.floating] = np.float32,
    seed: int = 1,
) -> dict[str, np.ndarray]:
    """PEFT 3D tensors: gate_up_proj is the inner ``base_layer`` wrapper, down_proj the outer."""
    rng = np.random.default_rng(seed)
    h, i, e = shape.hidden, shape.inter, shape.experts
    out = {}
    for layer in layers:
        stem = f"base_model.model.model.layers.{layer}.mlp.experts"
        out[f"{stem}.base_layer.lora_A.weight"] = rng.standard_normal((rank * e, h)).astype(dtype)
        out[f"{stem}.base_layer.lora_B.weight"] = rng.standard_normal((2 * i, rank * e)).astype(
            dtype
        )
        out[f"{stem}.lora_A.weight"] = rng.standard_normal((rank * e, i)).astype(dtype)
        out[f"{stem}.lora_B.weight"] = rng.standard_normal((h, rank * e)).astype(dtype)
    return out


def adapter_config(rank: int = 4, alpha: float = 8.0) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "use_rslora": False,
        "target_modules": [],
        "target_parameters": ["gate_up_proj", "down_proj"],
        "rank_pattern": {},
        "alpha_pattern": {},
        "bias": "none",
    }


def write_adapter(
    folder: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    shape: TinyShape = SHAPE,
    seed: int = 1,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(rank, alpha), indent=2))
    data = tensors if tensors is not None else adapter_tensors(shape, rank, seed=seed)
    save_file(data, str(folder / "adapter_model.safetensors"))
    return folder


def write_raw_weights(folder: Path, header: Mapping[str, object], data: bytes) -> None:
    """adapter_model.safetensors from a hand-made header (for headers that lie)."""
    raw = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def write_adapter_of_size(folder: Path, size: int, seed: int = 1) -> Path:
    """An adapter whose weights file is exactly ``size`` bytes (at least 2 KiB): the largest
    rank whose float32 tensors fit, the header padded with spaces (as the format allows) to
    make up the rest. Upload it to a registry whose max_rank allows that rank."""
    per_rank = sum(t.nbytes for t in adapter_tensors(rank=1).values())
    rank = max(1, (size - 2048) // per_rank)
    tensors = adapter_tensors(rank=rank, seed=seed)
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header).encode()
    padding = size - 8 - len(raw) - offset
    assert padding >= 0, f"{size} bytes is too small for rank {rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(rank), indent=2))
    data = b"".join(t.tobytes() for t in tensors.values())
    weights = struct.pack("<Q", len(raw) + padding) + raw + b" " * padding + data
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


class Collect:
    """A sink that receives a range into memory of its own, ``step`` bytes at most a time,
    stopping after ``stop_after`` steps if given."""

    def __init__(self, length: int, step: int = STEP_BYTES, stop_after: int = 0) -> None:
        self.data = bytearray(length)
        self.steps: list[int] = []
        self._step = step
        self._stop_after = stop_after

    def receive(self, n: int) -> memoryview:
        at = sum(self.steps)
        return memoryview(self.data)[at : at + min(n, self._step)]

    def received(self, n: int) -> bool:
        self.steps.append(n)
        return len(self.steps) != self._stop_after
