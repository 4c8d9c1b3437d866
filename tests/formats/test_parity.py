"""PEFT / transformers parity: the loaded base layers and packed adapters, run through
``kernels.moe_forward(backend="torch")``, reproduce the transformers MoE block's output.

Tolerance (float32 everywhere): max |ours - reference| <= 2e-5 · max |reference|. Both sides do
the same float32 math in a different order; observed errors are ~1e-7 relative, while a wrong
layout, order or scaling gives errors of order 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save

from executor_service.model_loader import BaseModel, load_base_model
from executor_service.packer import PackedAdapter, pack_adapter
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import LoRAContext, LoRASlots, moe_forward
from moelora.client.errors import InvalidArgument
from shared.adapter_format import AdapterFormat
from tests.formats.conftest import HFCheckpoint
from tests.formats.hf_models import HIDDEN, MODEL_TYPES, moe_block, run_block
from tests.formats.peft_adapters import load_peft_adapter, make_peft_adapter

RTOL = 2e-5
TOKENS = 24


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    error = (ours - reference).abs().max().item()
    assert error <= RTOL * scale, f"max error {error:.3e} vs tolerance {RTOL * scale:.3e}"


def hidden_states(seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_base_layers_match_transformers(
    hf_checkpoint: Callable[[str], HFCheckpoint], model_type: str
) -> None:
    checkpoint = hf_checkpoint(model_type)
    model = load_base_model(checkpoint.folder, "cpu", torch.float32, name="tiny")
    assert model.name == "tiny"
    assert set(model.layers) == set(model.spec.moe_layers)
    x = hidden_states()
    for index, layer in model.layers.items():
        reference = run_block(moe_block(checkpoint.model, index), x)
        assert_close(moe_forward(x, layer, backend="torch"), reference)


def test_loads_in_bf16_and_counts_bytes(hf_checkpoint: Callable[[str], HFCheckpoint]) -> None:
    folder = hf_checkpoint("qwen2_moe").folder
    f32 = load_base_model(folder, "cpu", torch.float32)
    bf16 = load_base_model(folder, "cpu", torch.bfloat16)
    assert f32.name == folder.name
    assert {layer.w13.dtype for layer in bf16.layers.values()} == {torch.bfloat16}
    assert bf16.nbytes * 2 == f32.nbytes
    # 3 layers × (router E·H + experts E·3·I·H + shared 3·Is·H + shared gate H) float32 values
    e, h, i, shared = 4, HIDDEN, 16, 24
    assert f32.nbytes == 3 * 4 * (e * h + e * 3 * i * h + 3 * shared * h + h)


def slots_for(packed: list[PackedAdapter], model: BaseModel, layer: int, rank: int) -> LoRASlots:
    """LoRASlots, one slot per packed adapter, zero-padded to ``rank`` as the executor does."""
    spec = model.spec
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    s = len(packed)
    slots = LoRASlots(
        a13=torch.zeros(s, e, rank, h),
        b13=torch.zeros(s, e, 2 * i, rank),
        a2=torch.zeros(s, e, rank, i),
        b2=torch.zeros(s, e, h, rank),
        enabled=torch.ones(s, dtype=torch.int32),
    )
    for slot, adapter in enumerate(packed):
        part = adapter.layers.get(layer)
        if part is None:
            continue
        for a, b, a_slots, b_slots in (
            (part.a13, part.b13, slots.a13, slots.b13),
            (part.a2, part.b2, slots.a2, slots.b2),
        ):
            if a is not None and b is not None:
                a_slots[slot, :, : a.shape[1]] = a
                b_slots[slot, :, :, : b.shape[2]] = b
    return slots


def check_adapter(
    peft_model: PeftModel, folder: Path, base: BaseModel, base_reference: HFCheckpoint
) -> None:
    """Tokens 0..T/2 use the adapter, the rest none: each half matches its reference."""
    config = json.loads((folder / "adapter_config.json").read_text())
    packed = pack_adapter(
        config, folder / "adapter_model.safetensors", base.spec, 16, torch.float32
    )
    x = hidden_states()
    token_slots = torch.tensor(
        [0] * (TOKENS // 2) + [-1] * (TOKENS - TOKENS // 2), dtype=torch.int32
    )
    inner = peft_model.get_submodule("base_model.model")
    for index, layer in base.layers.items():
        lora = LoRAContext(slots_for([packed], base, index, packed.rank + 2), token_slots)
        ours = moe_forward(x, layer, lora, backend="torch")
        with_adapter = run_block(moe_block(inner, index), x)
        without = run_block(moe_block(base_reference.model, index), x)
        # The adapter must matter, or this test could not fail.
        assert (with_adapter - without).abs().max() > 0.05 * without.abs().max()
        assert_close(ours[: TOKENS // 2], with_adapter[: TOKENS // 2])
        assert_close(ours[TOKENS // 2 :], without[TOKENS // 2 :])


PEFT_CASES = (
    [(t, "both") for t in MODEL_TYPES]
    + [
        (t, v)
        for t in ("qwen3_moe", "gpt_oss")
        for v in ("down_only", "gate_up_only", "rslora", "patterns")
    ]
    + [("qwen3_moe", "target_modules"), ("mixtral", "target_modules"), ("olmoe", "target_modules")]
)


@pytest.mark.parametrize(("model_type", "variant"), PEFT_CASES)
def test_peft_adapters_match(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path, model_type: str, variant: str
) -> None:
    checkpoint = hf_checkpoint(model_type)
    base = load_base_model(checkpoint.folder, "cpu", torch.float32)
    peft_model, folder = make_peft_adapter(model_type, variant, tmp_path)
    check_adapter(peft_model, folder, base, checkpoint)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_2d_adapters_match_peft_loading(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path, model_type: str
) -> None:
    """A 2D per-expert adapter (written by synthetic.py), as PEFT itself loads it.

    PEFT converts it to 3D on load, fusing gate and up block-diagonally with rank 2r, which
    needs equal gate and up ranks; it matches rank/alpha patterns against the converted keys
    (``experts.down_proj``) where we match the adapter's own module keys (``experts.3.down_proj``,
    the keys it was trained with), so the pattern here means the same under both readings.
    """
    checkpoint = hf_checkpoint(model_type)
    base = load_base_model(checkpoint.folder, "cpu", torch.float32)
    pattern = (
        {} if model_type == "mixtral" else {r"layers\.0\.mlp\.experts\.(\d+\.)?down_proj": 2.0}
    )
    adapter = SyntheticAdapter(
        format=AdapterFormat.PER_EXPERT, rank=3, alpha=5.0, alpha_pattern=pattern
    )
    folder = write_adapter(tmp_path, base.spec, adapter)
    check_adapter(load_peft_adapter(model_type, folder), folder, base, checkpoint)


def test_2d_unequal_ranks_pack_block_diagonally(tmp_path: Path) -> None:
    """PEFT cannot load gate/up of different ranks; the packing is checked against the
    per-expert deltas computed directly in float64 instead."""
    base = SyntheticBase("mixtral", hidden_size=48, moe_intermediate_size=16, num_experts=4)
    spec = write_base_checkpoint(tmp_path / "base", base, dtype=torch.float32)
    adapter = SyntheticAdapter(
        format=AdapterFormat.PER_EXPERT,
        rank=3,
        alpha=5.0,
        use_rslora=True,
        rank_pattern={"w3": 2, r"layers\.1\.block_sparse_moe\.experts\.2\.w1": 1},
    )
    folder = write_adapter(tmp_path / "adapter", spec, adapter)
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(folder / "adapter_model.safetensors")
    packed = pack_adapter(config, folder / "adapter_model.safetensors", spec, 5, torch.float32)
    i = spec.moe_intermediate_size

    def delta(layer: int, expert: int, module: str, rank: int) -> torch.Tensor:
        stem = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{module}"
        a = tensors[f"{stem}.lora_A.weight"].double()
        b = tensors[f"{stem}.lora_B.weight"].double()
        product: torch.Tensor = 5.0 / rank**0.5 * (b @ a)
        return product

    for layer, part in packed.layers.items():
        assert part.a13 is not None and part.b13 is not None
        assert part.a2 is not None and part.b2 is not None
        assert part.a13.shape[1] == 5  # gate 3 + up 2
        for expert in range(spec.num_experts):
            gate_rank = 1 if (layer, expert) == (1, 2) else 3
            w13 = part.b13[expert].double() @ part.a13[expert].double()
            torch.testing.assert_close(w13[:i], delta(layer, expert, "w1", gate_rank))
            torch.testing.assert_close(w13[i:], delta(layer, expert, "w3", 2))
            w2 = part.b2[expert].double() @ part.a2[expert].double()
            torch.testing.assert_close(w2, delta(layer, expert, "w2", 3))


def test_two_adapters_in_one_batch(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    checkpoint = hf_checkpoint("qwen3_moe")
    base = load_base_model(checkpoint.folder, "cpu", torch.float32)
    models, packed = [], []
    for seed, variant in enumerate(("both", "rslora")):
        peft_model, folder = make_peft_adapter("qwen3_moe", variant, tmp_path / variant, seed)
        config = json.loads((folder / "adapter_config.json").read_text())
        weights = (folder / "adapter_model.safetensors").read_bytes()
        packed.append(pack_adapter(config, weights, base.spec, 8, torch.float32))
        models.append(peft_model.get_submodule("base_model.model"))
    x = hidden_states()
    token_slots = torch.tensor([0, 1, -1] * (TOKENS // 3), dtype=torch.int32)
    for index, layer in base.layers.items():
        lora = LoRAContext(slots_for(packed, base, index, 8), token_slots)
        ours = moe_forward(x, layer, lora, backend="torch")
        references = [run_block(moe_block(m, index), x) for m in (*models, checkpoint.model)]
        for slot, reference in zip((0, 1, -1), references, strict=True):
            rows = token_slots == slot
            assert_close(ours[rows], reference[rows])


def test_bf16_packing_rounds_the_float32_fold(tmp_path: Path) -> None:
    spec = write_base_checkpoint(tmp_path / "base", SyntheticBase("gpt_oss"), dtype=torch.float32)
    folder = write_adapter(tmp_path / "adapter", spec, SyntheticAdapter(alpha=3.0))
    config = json.loads((folder / "adapter_config.json").read_text())
    weights = folder / "adapter_model.safetensors"
    f32 = pack_adapter(config, weights, spec, 8, torch.float32)
    bf16 = pack_adapter(config, weights, spec, 8, torch.bfloat16)
    assert bf16.nbytes * 2 == f32.nbytes
    for index, layer in f32.layers.items():
        for name in ("a13", "b13", "a2", "b2"):
            expected = getattr(layer, name)
            got = getattr(bf16.layers[index], name)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, expected.to(torch.bfloat16))


def test_fold_that_overflows_the_serving_dtype_is_refused(tmp_path: Path) -> None:
    spec = write_base_checkpoint(tmp_path / "base", SyntheticBase("olmoe"), dtype=torch.float32)
    folder = write_adapter(tmp_path / "adapter", spec, SyntheticAdapter(alpha=16.0, rank=8))
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(folder / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
    tensors[key][3, 5] = 40000.0  # finite in float16, but not once scaled by 16 / 8
    weights = save(tensors)
    assert pack_adapter(config, weights, spec, 8, torch.float32).rank == 8
    with pytest.raises(InvalidArgument, match="adapter LoRA b2 overflows float16 once scaled"):
        pack_adapter(config, weights, spec, 8, torch.float16)
