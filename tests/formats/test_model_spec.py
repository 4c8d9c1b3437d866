"""Reading base checkpoints written by transformers: spec, layout checks, fingerprint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import ExpertLayout, ModelSpec, read_checkpoint, read_model_spec
from tests.formats.conftest import HFCheckpoint
from tests.formats.hf_models import HIDDEN, INTERMEDIATE, MODEL_TYPES, build_model, save_model

Checkpoints = Callable[[str], HFCheckpoint]

EXPECTED = {
    # model_type: (moe_layers, experts, top_k, shared size, renormalize, layout)
    "qwen3_moe": ((0, 2), 4, 2, 0, True, ExpertLayout.PER_EXPERT),
    "qwen2_moe": ((0, 1, 2), 4, 2, 24, False, ExpertLayout.PER_EXPERT),
    "olmoe": ((0, 1, 2), 6, 2, 0, False, ExpertLayout.PER_EXPERT),
    "mixtral": ((0, 1, 2), 4, 2, 0, True, ExpertLayout.PER_EXPERT),
    "gpt_oss": ((0, 1, 2), 4, 2, 0, True, ExpertLayout.FUSED_TRANSPOSED),
    "deepseek_v3": ((1, 2), 8, 3, INTERMEDIATE, True, ExpertLayout.PER_EXPERT),
}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_reads_transformers_checkpoints(hf_checkpoint: Checkpoints, model_type: str) -> None:
    checkpoint = read_checkpoint(hf_checkpoint(model_type).folder)
    spec = checkpoint.spec
    moe_layers, experts, top_k, shared, renormalize, layout = EXPECTED[model_type]
    assert spec.model_type == model_type
    assert (spec.hidden_size, spec.moe_intermediate_size) == (HIDDEN, INTERMEDIATE)
    assert spec.moe_layers == moe_layers
    assert (spec.num_experts, spec.top_k, spec.num_layers) == (experts, top_k, 3)
    assert spec.shared_expert_intermediate_size == shared
    assert spec.norm_topk_prob is renormalize
    assert checkpoint.layout is layout
    assert spec.checkpoint_dtype == "float32"
    assert spec.fingerprint.startswith("sha256:") and len(spec.fingerprint) == 71
    assert set(checkpoint.layers) == set(moe_layers)


def test_deepseek_router_settings(hf_checkpoint: Checkpoints) -> None:
    spec = read_model_spec(hf_checkpoint("deepseek_v3").folder)
    assert (spec.n_group, spec.topk_group, spec.routed_scaling_factor) == (4, 2, 2.5)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_proto_round_trip(hf_checkpoint: Checkpoints, model_type: str) -> None:
    spec = read_model_spec(hf_checkpoint(model_type).folder)
    message = spec.to_proto("tiny")
    assert message.name == "tiny"
    assert list(message.moe_layers) == list(spec.moe_layers)
    assert ModelSpec.from_proto(message) == spec
    message.num_experts += 1
    with pytest.raises(InvalidArgument, match=r"BaseModel.num_experts is"):
        ModelSpec.from_proto(message)


def test_fingerprint_is_stable_and_content_sensitive(
    hf_checkpoint: Checkpoints, tmp_path: Path
) -> None:
    original = hf_checkpoint("qwen3_moe")
    first = read_model_spec(original.folder).fingerprint
    assert read_model_spec(original.folder).fingerprint == first
    # Resharding changes file layout and offsets but not the model: same fingerprint.
    sharded = save_model(original.model, tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert read_model_spec(sharded).fingerprint == first
    # Same architecture, other weights: different fingerprint.
    other = save_model(build_model("qwen3_moe", seed=1), tmp_path / "other")
    assert read_model_spec(other).fingerprint != first
    assert read_model_spec(hf_checkpoint("olmoe").folder).fingerprint != first


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_accepts_either_expert_count_key(hf_checkpoint: Checkpoints, tmp_path: Path) -> None:
    folder = _copy(hf_checkpoint("olmoe").folder, tmp_path)
    _edit_config(folder, num_experts=None, num_local_experts=6)
    assert read_model_spec(folder).num_experts == 6
    _edit_config(folder, num_experts=5)
    with pytest.raises(InvalidArgument, match="disagrees on the number of experts"):
        read_model_spec(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"hidden_size": None}, r"lacks hidden_size"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"moe_intermediate_size": "16"}, "moe_intermediate_size must be a non-negative integer"),
        (
            {"hidden_size": 64},
            r"model.layers.0.mlp.gate.weight has shape \[4, 48\], expected \[4, 64\]",
        ),
    ],
)
def test_rejects_bad_config(
    hf_checkpoint: Checkpoints, tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    folder = _copy(hf_checkpoint("qwen3_moe").folder, tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(InvalidArgument, match=message):
        read_model_spec(folder)


def test_rejects_missing_misshaped_and_quantized_tensors(
    hf_checkpoint: Checkpoints, tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("mixtral").folder, tmp_path)
    name = "model.layers.2.block_sparse_moe.experts.3.w3.weight"
    original = load_file(folder / "model.safetensors")[name]

    _edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(InvalidArgument, match=f"checkpoint tensor {name} is missing"):
        read_model_spec(folder)

    _edit_tensors(folder, lambda t: t.update({name: original[:, :-1].contiguous()}))
    with pytest.raises(InvalidArgument, match=rf"{name} has shape \[16, 47\], expected \[16, 48\]"):
        read_model_spec(folder)

    _edit_tensors(folder, lambda t: t.update({name: original.to(torch.int8)}))
    with pytest.raises(InvalidArgument, match=f"{name} is I8; BF16, F16 and F32 checkpoints"):
        read_model_spec(folder)

    _edit_tensors(folder, lambda t: t.update({name: original.to(torch.bfloat16)}))
    with pytest.raises(InvalidArgument, match=f"{name} is BF16 but .* is F32"):
        read_model_spec(folder)


def test_rejects_missing_files(hf_checkpoint: Checkpoints, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"no config.json"):
        read_model_spec(tmp_path)
    folder = _copy(hf_checkpoint("olmoe").folder, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InvalidArgument, match=r"neither model.safetensors nor"):
        read_model_spec(folder)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "../escape.safetensors"}})
    )
    with pytest.raises(InvalidArgument, match="is not a plain file name"):
        read_model_spec(folder)


def test_bf16_checkpoint(tmp_path: Path) -> None:
    model = build_model("olmoe")
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    spec = read_model_spec(save_model(model, tmp_path / "bf16"))
    assert spec.checkpoint_dtype == "bfloat16"
    assert spec.to_proto("x").checkpoint_dtype != 0
