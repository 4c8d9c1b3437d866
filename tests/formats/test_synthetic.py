"""synthetic.py writes what transformers and PEFT themselves accept, with the same meaning.

For every model type: transformers loads the synthetic checkpoint with every MoE tensor found
(no unexpected key, no missing MoE key), PEFT loads the synthetic adapter onto it, and the
executor's loader + packer reproduce that transformers/PEFT block (float32, see test_parity).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from executor_service.model_loader import load_base_model
from executor_service.packer import pack_adapter
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import LoRAContext, moe_forward
from moelora.client.model_spec import ExpertLayout, read_checkpoint
from moelora.client.model_types import SUPPORTED_MODEL_TYPES
from shared.adapter_format import AdapterFormat
from tests.formats.hf_models import moe_block, run_block
from tests.formats.test_parity import assert_close, slots_for

#: Every model type of the table, most with the defaults; some exercise dense layers, a shared
#: expert or grouped routing.
BASES = {name: SyntheticBase(name) for name in SUPPORTED_MODEL_TYPES} | {
    "qwen3_moe": SyntheticBase("qwen3_moe", num_layers=3, dense_layers=(1,), norm_topk_prob=False),
    "qwen2_moe": SyntheticBase("qwen2_moe", shared_expert_intermediate_size=48),
    "deepseek_v3": SyntheticBase(
        "deepseek_v3",
        num_layers=3,
        dense_layers=(0,),
        shared_expert_intermediate_size=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
}
MOE_KEYS = ("mlp.experts", "mlp.gate.", "mlp.router", "mlp.shared", "block_sparse_moe")


def _load_transformers(folder: Path) -> torch.nn.Module:
    # With output_loading_info the result is (model, info); transformers' stubs say otherwise.
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, dtype=torch.float32
    )
    model: torch.nn.Module = loaded[0]
    info: dict[str, Any] = loaded[1]
    assert not info["unexpected_keys"]
    missing_moe = [key for key in info["missing_keys"] if any(m in key for m in MOE_KEYS)]
    assert not missing_moe, f"transformers did not find {missing_moe}"
    model.eval()
    return model


def _check(folder: Path, adapter_folder: Path, model: torch.nn.Module) -> None:
    base = load_base_model(folder, "cpu", torch.float32)
    config = json.loads((adapter_folder / "adapter_config.json").read_text())
    weights = adapter_folder / "adapter_model.safetensors"
    packed = pack_adapter(config, weights, base.spec, 16, torch.float32)
    h = base.spec.hidden_size
    x = torch.randn(16, h, generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([0, -1] * 8, dtype=torch.int32)
    base_blocks = {index: run_block(moe_block(model, index), x) for index in base.layers}
    peft_model = PeftModel.from_pretrained(model, adapter_folder)
    inner = peft_model.get_submodule("base_model.model")
    for index, layer in base.layers.items():
        lora = LoRAContext(slots_for([packed], base, index, packed.rank), tokens)
        ours = moe_forward(x, layer, lora, backend="torch")
        with_adapter = run_block(moe_block(inner, index), x)
        assert (with_adapter - base_blocks[index]).abs().max() > 0.05 * with_adapter.abs().max()
        assert_close(ours[tokens == 0], with_adapter[tokens == 0])
        assert_close(ours[tokens == -1], base_blocks[index][tokens == -1])


@pytest.mark.parametrize("model_type", list(BASES))
def test_transformers_and_peft_accept_synthetic_output(tmp_path: Path, model_type: str) -> None:
    folder = tmp_path / "base"
    spec = write_base_checkpoint(folder, BASES[model_type], dtype=torch.float32, seed=5)
    adapter = SyntheticAdapter(rank=4, alpha=6.0, use_rslora=model_type == "olmoe")
    adapter_folder = write_adapter(tmp_path / "adapter", spec, adapter, seed=6)
    _check(folder, adapter_folder, _load_transformers(folder))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_fused_layout_and_shards(tmp_path: Path, model_type: str) -> None:
    """transformers' in-memory (fused) layout, sharded, loads in transformers and here alike;
    a 2D adapter on top of it as well."""
    folder = tmp_path / "base"
    spec = write_base_checkpoint(
        folder,
        BASES[model_type],
        dtype=torch.float32,
        layout=ExpertLayout.FUSED,
        shard_bytes=40_000,
    )
    assert read_checkpoint(folder).layout is ExpertLayout.FUSED
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    # (PEFT 0.21 drops a 2D adapter that adapts only gate and up, so both targets here.)
    adapter = SyntheticAdapter(rank=2, format=AdapterFormat.PER_EXPERT)
    adapter_folder = write_adapter(tmp_path / "adapter", spec, adapter)
    _check(folder, adapter_folder, _load_transformers(folder))


def test_bf16_checkpoint_keeps_deepseek_bias_in_float32(tmp_path: Path) -> None:
    spec = write_base_checkpoint(tmp_path, BASES["deepseek_v3"], dtype=torch.bfloat16)
    assert spec.checkpoint_dtype == "bfloat16"
    checkpoint = read_checkpoint(tmp_path)
    bias = checkpoint.layers[1].score_correction_bias
    assert bias is not None and checkpoint.tensors[bias].info.dtype == "F32"
    model = load_base_model(tmp_path, "cpu", torch.bfloat16)
    assert model.layers[1].w13.dtype == torch.bfloat16
    correction = model.layers[1].e_score_correction_bias
    assert correction is not None and correction.dtype == torch.float32


def test_rejects_impossible_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="olmoe has no shared expert"):
        write_base_checkpoint(tmp_path, SyntheticBase("olmoe", shared_expert_intermediate_size=8))
    with pytest.raises(ValueError, match="prefix"):
        write_base_checkpoint(tmp_path, SyntheticBase("deepseek_v3", dense_layers=(1,)))
    spec = write_base_checkpoint(tmp_path, SyntheticBase("olmoe"))
    with pytest.raises(ValueError, match="targets must be"):
        write_adapter(tmp_path / "a", spec, SyntheticAdapter(targets=("q_proj",)))
