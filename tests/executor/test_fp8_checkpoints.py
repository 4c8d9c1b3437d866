"""Block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3-FP8): read, loaded with their experts kept
FP8 on the device, and served through Forward with per-request LoRA.

The reference is transformers + PEFT on the same tiny model whose expert weights are exactly
the values the FP8 checkpoint stands for (each rounded through quantise → dequantise before
saving), so the executor's float32 answers must match to float32's rounding: FP8 changes
what the weights are, not how exactly they are applied.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from executor_service.model_loader import load_base_model
from executor_service.synthetic import SyntheticAdapter, quantize_checkpoint, write_adapter
from kernels.fp8 import dequantize, quantize
from kernels.reference import moe_forward_reference
from kernels.synthetic import relative_error, worst_row_error
from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import ModelSpec, read_checkpoint
from moelora.v1 import tensor_pb2
from tests.executor.conftest import Placement, StartExecutor
from tests.executor.worlds import TOKENS, World, new_world
from tests.formats.hf_models import HIDDEN, build_model, moe_block, run_block
from tests.kernels.test_fp8 import W8A8_TOLERANCE

#: FP8 scale blocks are 128 wide and gate/up blocks stack: I must be a multiple of 128.
FP8_INTERMEDIATE = 128
#: float32 rounding only, per row relative to the row's norm: with I = 128 the tiny model's
#: outputs reach a few hundred, where float32's absolute tolerance of the other worlds is
#: below one ulp (measured: 6e-7).
ROW_TOLERANCE = 1e-5
ADAPTERS = {"alpha": SyntheticAdapter(rank=4), "beta": SyntheticAdapter(rank=8, alpha=4.0)}


def _round_experts_through_fp8(model: PreTrainedModel) -> None:
    """Replace every routed and shared expert projection by the value its FP8 form stands for."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            expert = ".experts." in name and name.endswith(("gate_up_proj", "down_proj"))
            shared = ".shared_experts." in name and name.endswith("proj.weight")
            if expert or shared:
                param.copy_(dequantize(*quantize(param), torch.float32))


@dataclass
class Fp8World:
    world: World
    spec: ModelSpec


def _build(model_type: str, root: Path) -> Fp8World:
    base = build_model(model_type, moe_intermediate_size=FP8_INTERMEDIATE)
    _round_experts_through_fp8(base)
    checkpoint = root / "base"
    base.save_pretrained(checkpoint)
    spec = quantize_checkpoint(checkpoint)
    world = new_world(model_type, checkpoint, root / "adapters")
    generator = torch.Generator().manual_seed(7)
    for layer in spec.moe_layers:
        world.inputs[layer] = torch.randn(TOKENS, HIDDEN, generator=generator)
        world.reference[(None, layer)] = run_block(moe_block(base, layer), world.inputs[layer])
    for seed, (name, adapter) in enumerate(ADAPTERS.items(), start=1):
        folder = write_adapter(world.adapter_dir / name, spec, adapter, seed=seed)
        peft = PeftModel.from_pretrained(copy.deepcopy(base), folder)
        for layer in spec.moe_layers:
            block = moe_block(cast(PreTrainedModel, peft.base_model.model), layer)
            world.reference[(name, layer)] = run_block(block, world.inputs[layer])
    return Fp8World(world, spec)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def fp8_world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Fp8World:
    return _build(request.param, tmp_path_factory.mktemp(f"fp8_{request.param}"))


def test_the_checkpoint_is_read_as_fp8(fp8_world: Fp8World) -> None:
    assert fp8_world.spec.checkpoint_dtype == "float8_e4m3fn"
    assert ModelSpec.from_proto(fp8_world.spec.to_proto("fp8")) == fp8_world.spec
    model = load_base_model(fp8_world.world.checkpoint, "cpu", torch.float32)
    assert model.weight_format == "fp8_e4m3_block128"
    layer = model.layers[fp8_world.spec.moe_layers[0]]
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w2.dtype == torch.float8_e4m3fn
    e, i = fp8_world.spec.num_experts, FP8_INTERMEDIATE
    assert layer.w13_scale is not None and layer.w2_scale is not None
    assert tuple(layer.w13_scale.shape) == (e, 2 * i // 128, 1)  # H = 48: one column block
    assert tuple(layer.w2_scale.shape) == (e, 1, i // 128)


def test_forward_serves_fp8_experts_with_per_request_lora(
    fp8_world: Fp8World, start_executor: StartExecutor, placement: Placement
) -> None:
    """On the CPU within float32's rounding of PEFT; on the GPU (the Triton kernels' W8A16
    loops in float32, CUDA graphs) within the kernels' float32 tolerance."""
    world = fp8_world.world
    running = start_executor(world, **placement.settings)
    info = running.client.get_executor_info()
    assert info.weight_format == "fp8_e4m3_block128"
    assert info.base_model.checkpoint_dtype == tensor_pb2.DATA_TYPE_FLOAT8_E4M3
    for layer in world.moe_layers:
        segments: list[tuple[int, str | None]] = [(5, "alpha"), (3, None), (4, "beta")]
        result = running.client.forward(layer, world.inputs[layer], segments)
        expected = world.expected(layer, segments)
        if placement.device == "cpu":
            worst = worst_row_error(result.output, expected)
            assert worst < ROW_TOLERANCE, f"layer {layer}: worst row error {worst:.2e}"
        else:
            placement.check(result.output, expected)


def test_fp8_activations_quantise_the_experts_inputs(
    fp8_world: Fp8World, start_executor: StartExecutor, placement: Placement
) -> None:
    """--fp8-activations: the executor says so (weight_format) and answers as the reference
    that quantises the experts' inputs (W8A8), which the unquantised answer misses by far
    more than float32's rounding. On the GPU (the FP8 tensor cores) within the kernels' W8A8
    float32 tolerance, whose bound for an input on an FP8 rounding tie leaves no room for the
    second check there (tests/kernels/test_fp8.py makes it)."""
    world = fp8_world.world
    running = start_executor(world, fp8_activations=True, **placement.settings)
    assert running.client.get_executor_info().weight_format == "fp8_e4m3_block128_w8a8"
    model = load_base_model(world.checkpoint, "cpu", torch.float32, fp8_activations=True)
    for layer in world.moe_layers:
        hidden = world.inputs[layer]
        result = running.client.forward(layer, hidden, [(TOKENS, None)])
        expected = moe_forward_reference(hidden, model.layers[layer])
        if placement.device != "cpu":
            whole, row = W8A8_TOLERANCE[torch.float32]
            assert relative_error(result.output, expected) < whole, f"layer {layer}"
            assert worst_row_error(result.output, expected) < row, f"layer {layer}"
            continue
        assert worst_row_error(result.output, expected) < ROW_TOLERANCE, f"layer {layer}"
        unquantised = world.expected(layer, [(TOKENS, None)])
        assert worst_row_error(result.output, unquantised) > 100 * ROW_TOLERANCE


def test_fp8_activations_refuse_experts_that_are_not_fp8(qwen_world: World) -> None:
    with pytest.raises(InvalidArgument, match=r"--fp8-activations: .* not FP8") as refused:
        load_base_model(qwen_world.checkpoint, "cpu", torch.float32, fp8_activations=True)
    assert refused.value.field == "fp8_activations"


def _rewrite(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    path = folder / "model.safetensors"
    with safe_open(path, framework="pt") as stored:
        tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


def _copy(fp8_world: Fp8World, tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "copy"
    folder.mkdir()
    for file in fp8_world.world.checkpoint.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    layer = fp8_world.spec.moe_layers[0]
    mlp = f"model.layers.{layer}.mlp.experts.0.down_proj"
    return folder, mlp


def test_a_missing_or_misshaped_scale_is_named(fp8_world: Fp8World, tmp_path: Path) -> None:
    folder, down = _copy(fp8_world, tmp_path)
    _rewrite(folder, {f"{down}.weight_scale_inv": None})
    with pytest.raises(InvalidArgument, match=f"{down}.weight_scale_inv is missing"):
        read_checkpoint(folder)
    _rewrite(folder, {f"{down}.weight_scale_inv": torch.ones(2, 2)})
    with pytest.raises(InvalidArgument, match=r"expected F32 \[1, 1\]"):
        read_checkpoint(folder)


def test_other_block_sizes_are_refused(fp8_world: Fp8World, tmp_path: Path) -> None:
    folder, _ = _copy(fp8_world, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="weight_block_size is \\[64, 64\\]"):
        read_checkpoint(folder)
