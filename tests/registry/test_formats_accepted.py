"""What the executor side writes the registry accepts: checkpoints and adapters
from executor_service.synthetic (every model type, 3D and 2D formats, bf16),
registered and uploaded through the real server, with the layout reported."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from moelora.v1 import registry_pb2, tensor_pb2
from shared.adapter_format import AdapterFormat
from tests.registry.conftest import Served

CASES = [
    ("qwen3_moe", AdapterFormat.TARGET_PARAMETERS, registry_pb2.ADAPTER_FORMAT_PEFT_3D),
    ("mixtral", AdapterFormat.PER_EXPERT, registry_pb2.ADAPTER_FORMAT_PEFT_2D),
    ("gpt_oss", AdapterFormat.TARGET_PARAMETERS, registry_pb2.ADAPTER_FORMAT_PEFT_3D),
    ("deepseek_v3", AdapterFormat.PER_EXPERT, registry_pb2.ADAPTER_FORMAT_PEFT_2D),
]


@pytest.mark.parametrize(("model_type", "layout", "expected"), CASES)
def test_synthetic_adapters_are_accepted(
    serve: Callable[..., Served],
    tmp_path: Path,
    model_type: str,
    layout: AdapterFormat,
    expected: int,
) -> None:
    spec = write_base_checkpoint(tmp_path / "base", SyntheticBase(model_type))
    adapter = write_adapter(
        tmp_path / "adapter",
        spec,
        SyntheticAdapter(rank=4, alpha=8.0, format=layout),
        dtype=torch.bfloat16,
    )
    with serve().client() as client:
        client.register_base_model(spec.to_proto("base"))
        version = client.upload(adapter, "a", "base")
    assert version.format == expected
    assert version.dtype == "bfloat16"
    assert list(version.layers) == list(spec.moe_layers)
    assert set(version.target_parameters) == {"gate_up_proj", "down_proj"}
    # 2D gate and up pack into one w13 LoRA of rank 2r (block-diagonal).
    assert version.rank == (8 if layout is AdapterFormat.PER_EXPERT else 4)


def test_an_fp8_base_model_registers_and_takes_adapters(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    """DeepSeek-V3's block-scaled FP8 checkpoints: the registry keeps checkpoint_dtype."""
    base = SyntheticBase("deepseek_v3", moe_intermediate_size=128)
    spec = write_base_checkpoint(tmp_path / "base", base, fp8=True)
    adapter = write_adapter(tmp_path / "adapter", spec, SyntheticAdapter(rank=4))
    with serve().client() as client:
        client.register_base_model(spec.to_proto("base"))
        stored = client.get_base_model("base")
        version = client.upload(adapter, "a", "base")
    assert stored.checkpoint_dtype == tensor_pb2.DATA_TYPE_FLOAT8_E4M3
    assert stored.fingerprint == spec.fingerprint
    assert list(version.layers) == list(spec.moe_layers)
