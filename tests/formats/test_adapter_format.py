"""Adapter inspection: PEFT's own adapters are understood; every rejection rule names the key."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import ModelSpec, read_model_spec
from moelora.client.safetensors_header import parse_bytes, read_header
from shared.adapter_format import (
    AdapterFormat,
    AdapterLayout,
    Projection,
    check_finite,
    inspect_adapter,
    parse_adapter_config,
)
from tests.formats.conftest import HFCheckpoint
from tests.formats.peft_adapters import make_peft_adapter

Tensors = dict[str, torch.Tensor]
P = "base_model.model.model.layers"


def _inspect_folder(folder: Path, spec: ModelSpec, max_rank: int = 16) -> AdapterLayout:
    config = parse_adapter_config((folder / "adapter_config.json").read_bytes())
    return inspect_adapter(
        config, read_header(folder / "adapter_model.safetensors"), spec, max_rank
    )


@pytest.mark.parametrize(
    ("variant", "ranks", "scalings"),
    [
        ("both", (4, 4), (2.0, 2.0)),
        ("down_only", (0, 3), (None, 5 / 3)),
        ("rslora", (4, 4), (3.0, 3.0)),
        ("patterns", (4, 2), (3 / 4, 4.0)),
        ("target_modules", (6, 3), (2.0, 2.0)),
    ],
)
def test_peft_adapters(
    hf_checkpoint: Callable[[str], HFCheckpoint],
    tmp_path: Path,
    variant: str,
    ranks: tuple[int, int],
    scalings: tuple[float | None, float],
) -> None:
    spec = read_model_spec(hf_checkpoint("qwen3_moe").folder)
    _, folder = make_peft_adapter("qwen3_moe", variant, tmp_path)
    layout = _inspect_folder(folder, spec)
    assert layout.format is AdapterFormat.TARGET_PARAMETERS
    assert set(layout.layers) == {0, 2}
    assert layout.rank == max(ranks)
    assert layout.dtype == "F32"
    for layer in layout.layers.values():
        assert (layer.w13_rank, layer.w2_rank) == ranks
        by_projection = {pair.projection: pair for pair in layer.pairs}
        for projection, scaling in zip(
            (Projection.GATE_UP, Projection.DOWN), scalings, strict=True
        ):
            if scaling is None:
                assert projection not in by_projection
            else:
                assert by_projection[projection].scaling == pytest.approx(scaling)
                assert by_projection[projection].expert is None


def test_mixtral_and_gpt_oss_peft_adapters(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    for model_type in ("mixtral", "gpt_oss"):
        spec = read_model_spec(hf_checkpoint(model_type).folder)
        _, folder = make_peft_adapter(model_type, "both", tmp_path / model_type)
        layout = _inspect_folder(folder, spec)
        assert layout.target_parameters == ("gate_up_proj", "down_proj")
        assert {(x.w13_rank, x.w2_rank) for x in layout.layers.values()} == {(4, 4)}


def test_qwen2_moe_shared_expert_lora_is_rejected(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    # With target_modules, PEFT adapts qwen2_moe's shared expert (nn.Linear), not the experts.
    spec = read_model_spec(hf_checkpoint("qwen2_moe").folder)
    _, folder = make_peft_adapter("qwen2_moe", "target_modules", tmp_path)
    with pytest.raises(InvalidArgument, match=r"unknown adapter key .*shared_expert"):
        _inspect_folder(folder, spec)


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    """H=48, I=16, E=4, layers 0 and 2 MoE, layer 1 dense."""
    base = SyntheticBase(
        "qwen3_moe",
        hidden_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_layers=3,
        dense_layers=(1,),
    )
    return write_base_checkpoint(tmp_path_factory.mktemp("base"), base, dtype=torch.float32)


def _adapter(spec: ModelSpec, tmp_path: Path, **kwargs: Any) -> tuple[dict[str, Any], Tensors]:
    folder = write_adapter(tmp_path / "adapter", spec, SyntheticAdapter(**kwargs))
    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(folder / "adapter_model.safetensors")


def _inspect(
    spec: ModelSpec, config: dict[str, Any], tensors: Tensors, max_rank: int = 16
) -> AdapterLayout:
    return inspect_adapter(config, parse_bytes(save(tensors)), spec, max_rank)


def test_2d_adapter_packs_gate_and_up_block_diagonally(spec: ModelSpec, tmp_path: Path) -> None:
    config, tensors = _adapter(
        spec,
        tmp_path,
        format=AdapterFormat.PER_EXPERT,
        rank=4,
        alpha=8,
        rank_pattern={r"experts\.1\.up_proj": 3},
    )
    layout = _inspect(spec, config, tensors)
    assert layout.format is AdapterFormat.PER_EXPERT
    layer = layout.layers[0]
    assert (layer.w13_rank, layer.w2_rank) == (8, 4)
    up = {p.expert: p for p in layer.pairs if p.projection is Projection.UP}
    assert (up[0].rank_offset, up[0].rank, up[0].scaling) == (4, 4, 2.0)
    assert (up[1].rank, up[1].scaling) == (3, 8 / 3)
    with pytest.raises(InvalidArgument, match=r"packs to rank 8 .*ranks add up.* max rank 7"):
        _inspect(spec, config, tensors, max_rank=7)


def _rename(tensors: Tensors, old: str, new: str) -> Tensors:
    return {key.replace(old, new): value for key, value in tensors.items()}


def _set(tensors: Tensors, key: str, value: torch.Tensor | None) -> Tensors:
    changed = dict(tensors)
    if value is None:
        changed.pop(key)
    else:
        changed[key] = value
    return changed


A_GU = f"{P}.0.mlp.experts.base_layer.lora_A.weight"
B_GU = f"{P}.0.mlp.experts.base_layer.lora_B.weight"
A_D = f"{P}.0.mlp.experts.lora_A.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: _set(t, f"{P}.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 48)),
            r"unknown adapter key .*self_attn\.q_proj",
        ),
        (
            lambda t: _set(t, "model.layers.0.mlp.experts.lora_A.weight", torch.zeros(4, 48)),
            r"unknown adapter key model\.layers\.0",
        ),
        (lambda t: _rename(t, "layers.2.", "layers.1."), r"layer 1, which is not an MoE layer"),
        (lambda t: _rename(t, "layers.2.", "layers.7."), r"layer 7, but the base model has 3"),
        (lambda t: _set(t, A_GU, torch.zeros(16, 40)), r"fit neither gate_up_proj"),
        (lambda t: _set(t, A_GU, torch.zeros(12, 48)), r"has 12 rank rows but .* has 16"),
        (lambda t: _set(t, B_GU, None), r"base_layer\.lora_B\.weight is missing"),
        (lambda t: _set(t, A_GU, torch.zeros(16, 48, dtype=torch.int32)), r"is I32; LoRA weights"),
        (lambda t: _set(t, A_GU, torch.zeros(16, 48, dtype=torch.float16)), "share one dtype"),
        (lambda t: _set(t, A_GU, torch.zeros(16, 48, 1)), "must be 2-D"),
        (lambda t: _set(t, A_GU, torch.zeros(0, 48)) | {B_GU: torch.zeros(32, 0)}, "rank 0"),
        (
            lambda t: (
                {k: v for k, v in t.items() if "base_layer" not in k}
                | {A_GU.replace("base_layer.", "base_layer.base_layer."): t[A_GU]}
            ),
            "unknown adapter key",
        ),
        (lambda t: {}, "holds no tensors"),
    ],
)
def test_rejects_bad_3d_tensors(
    spec: ModelSpec, tmp_path: Path, edit: Callable[[Tensors], Tensors], message: str
) -> None:
    config, tensors = _adapter(spec, tmp_path, rank=4)
    with pytest.raises(InvalidArgument, match=message):
        _inspect(spec, config, edit(tensors))


def test_rejects_ranks_that_disagree_with_config(spec: ModelSpec, tmp_path: Path) -> None:
    config, tensors = _adapter(spec, tmp_path, rank=4)
    e = spec.num_experts
    bad = _set(tensors, A_D, torch.zeros(2 * e, 16)) | {
        A_D.replace("A", "B"): torch.zeros(48, 2 * e)
    }
    with pytest.raises(
        InvalidArgument, match=r"has rank 2 .* gives model.layers.0.mlp.experts.down_proj r=4"
    ):
        _inspect(spec, config, bad)
    bad = _set(tensors, A_D, torch.zeros(10, 16)) | {A_D.replace("A", "B"): torch.zeros(48, 10)}
    with pytest.raises(InvalidArgument, match="not a multiple of the 4 experts"):
        _inspect(spec, config, bad)
    # Both pairs shaped like gate_up_proj: the nesting cannot tell, the second is refused.
    duplicate = tensors | {A_D: tensors[A_GU].clone(), A_D.replace("A", "B"): tensors[B_GU].clone()}
    with pytest.raises(
        InvalidArgument, match=r"adapts model\.layers\.0\.mlp\.experts\.gate_up_proj a second"
    ):
        _inspect(spec, config, duplicate)
    with pytest.raises(InvalidArgument, match=r"packs to rank 4, above the executor's max rank 3"):
        _inspect(spec, config, tensors, max_rank=3)


def test_rejects_untargeted_parameters(spec: ModelSpec, tmp_path: Path) -> None:
    config, tensors = _adapter(spec, tmp_path, rank=4)
    with pytest.raises(InvalidArgument, match=r"adapts gate_up_proj, which .* does not name"):
        _inspect(spec, config | {"target_parameters": ["down_proj"]}, tensors)
    # A layer-qualified target applies to that layer only, as in PEFT.
    only_0 = config | {"target_parameters": ["layers.0.mlp.experts.gate_up_proj", "down_proj"]}
    with pytest.raises(
        InvalidArgument, match=r"layers.2.mlp.experts.base_layer.lora_A.weight adapts"
    ):
        _inspect(spec, only_0, tensors)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": None}, "adapter_config.json lacks r"),
        ({"lora_alpha": None}, "adapter_config.json lacks lora_alpha"),
        ({"r": 0}, "r must be at least 1"),
        ({"peft_type": "IA3"}, "peft_type must be LORA"),
        ({"use_dora": True}, "use_dora=true is not supported"),
        ({"target_parameters": None, "target_modules": None}, "names neither"),
        ({"rank_pattern": {"down_proj": "4"}}, "rank_pattern down_proj must be a non-negative"),
        ({"rank_pattern": {"(": 4}}, "pattern '\\(' is not a regex"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false"),
        ({"alpha_pattern": {r"(a)\1": 2}}, r"not a regex RE2 accepts .*invalid escape"),
        ({"rank_pattern": {"down(?=_proj)": 2}}, r"not a regex RE2 accepts"),
        ({"rank_pattern": {"x{1000}{1000}": 2}}, r"not a regex RE2 accepts"),
        ({"rank_pattern": {f"p{n}": 2 for n in range(1025)}}, "more than 1024 entries"),
        ({"target_modules": "(?<=a)b"}, r"target_modules '\(\?<=a\)b' is not a regex RE2"),
    ],
)
def test_rejects_bad_config(
    spec: ModelSpec, tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    config, tensors = _adapter(spec, tmp_path, rank=4)
    config = {k: v for k, v in (config | changes).items() if v is not None}
    with pytest.raises(InvalidArgument, match=message):
        _inspect(spec, config, tensors)


@pytest.mark.parametrize(
    "pattern",
    ["(.|.){40}Z", ".{0,40}" * 30 + "Z", "(a|aa)+$", "(x+)+y", ".*.*.*.*.*.*x"],
)
def test_patterns_that_backtrack_match_in_linear_time(
    spec: ModelSpec, tmp_path: Path, pattern: str
) -> None:
    """Each of these takes Python's re minutes to hours on a 40-character key; RE2 matches
    them (none matches here, so the defaults apply) in well under a second in all."""
    config, tensors = _adapter(spec, tmp_path, rank=4)
    config = config | {"rank_pattern": {pattern: 8}, "alpha_pattern": {pattern: 2.0}}
    start = time.monotonic()
    layout = _inspect(spec, config, tensors)
    assert time.monotonic() - start < 1.0
    assert layout.rank == 4


def test_rejects_bad_2d_adapters(spec: ModelSpec, tmp_path: Path) -> None:
    config, tensors = _adapter(spec, tmp_path, rank=4, format=AdapterFormat.PER_EXPERT)
    stem = f"{P}.2.mlp.experts.3.up_proj"
    missing = {k: v for k, v in tensors.items() if not k.startswith(stem)}
    with pytest.raises(
        InvalidArgument, match=rf"{stem}.lora_A.weight is missing: 2D adapters need all 4"
    ):
        _inspect(spec, config, missing)
    with pytest.raises(InvalidArgument, match="names expert 9; the model has 4"):
        _inspect(spec, config, _rename(tensors, "experts.3.", "experts.9."))
    with pytest.raises(InvalidArgument, match=r"do not fit the base model: expected A \(r, 48\)"):
        _inspect(spec, config, _set(tensors, f"{stem}.lora_A.weight", torch.zeros(4, 16)))
    with pytest.raises(
        InvalidArgument, match=r"adapts model.layers.0.mlp.experts.0.gate_proj, which"
    ):
        _inspect(spec, config | {"target_modules": ["up_proj", "down_proj"]}, tensors)
    assert _inspect(
        spec, config | {"target_modules": r".*experts\.\d+\.(gate|up|down)_proj"}, tensors
    )
    with pytest.raises(InvalidArgument, match=r"unknown adapter key .*experts.0.w1"):
        _inspect(spec, config, _rename(tensors, "gate_proj", "w1"))
    mixed = tensors | {A_D: torch.zeros(16, 16), A_D.replace("A", "B"): torch.zeros(48, 16)}
    with pytest.raises(InvalidArgument, match="adapter mixes the 3D format"):
        _inspect(spec, config, mixed)


def test_gpt_oss_needs_3d(tmp_path: Path) -> None:
    base = write_base_checkpoint(tmp_path / "gpt", SyntheticBase("gpt_oss"), dtype=torch.float32)
    qwen = write_base_checkpoint(tmp_path / "qwen", SyntheticBase("qwen3_moe"), dtype=torch.float32)
    config, tensors = _adapter(qwen, tmp_path, format=AdapterFormat.PER_EXPERT)
    with pytest.raises(
        InvalidArgument, match=r"unknown adapter key .*experts\.0\.\w+_proj.*\(base_model\S+\)$"
    ):
        _inspect(base, config, tensors)


def test_mixtral_2d_paths(tmp_path: Path) -> None:
    base = write_base_checkpoint(tmp_path / "mix", SyntheticBase("mixtral"), dtype=torch.float32)
    config, tensors = _adapter(base, tmp_path, format=AdapterFormat.PER_EXPERT, rank=2)
    assert any(".block_sparse_moe.experts.0.w1." in key for key in tensors)
    assert _inspect(base, config, tensors).layers[0].w13_rank == 4
    renamed = _rename(tensors, "block_sparse_moe", "mlp")
    assert _inspect(base, config, renamed).layers[0].w13_rank == 4


def _nan_file(dtype: torch.dtype, value: float) -> bytes:
    tensors = {
        "ok": torch.ones(3, dtype=dtype),
        "bad": torch.tensor([1.0, value, 2.0], dtype=dtype),
    }
    return save(tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_finite_finds_nan_and_inf(dtype: torch.dtype, value: float) -> None:
    blob = _nan_file(dtype, value)
    header = parse_bytes(blob)
    with pytest.raises(InvalidArgument, match="tensor bad contains NaN or Inf"):
        check_finite(header, blob)
    with pytest.raises(InvalidArgument, match="tensor bad contains NaN or Inf"):
        check_finite(header, memoryview(blob)[header.data_start :], data_offset=header.data_start)


def test_check_finite_accepts_finite_extremes() -> None:
    big = torch.tensor([torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max, 0.0])
    blob = save({"x": big.to(torch.bfloat16), "i": torch.tensor([-1], dtype=torch.int32)})
    check_finite(parse_bytes(blob), blob)
    with pytest.raises(InvalidArgument, match="outside the data given"):
        check_finite(parse_bytes(blob), blob[:-2])
    assert np.isfinite(np.float32(big[0]))
