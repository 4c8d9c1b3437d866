"""The start-up pack of a CUDA executor (pack_warmup.py) works for every model type: it packs
its tiny adapters of each format the type has, and gives back all the memory it took."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.adapters import PackSettings
from executor_service.host_pool import HostPool
from executor_service.pack_warmup import warm_up_packing
from executor_service.synthetic import SyntheticBase, write_base_checkpoint
from moelora.client.model_types import SUPPORTED_MODEL_TYPES

CPU = torch.device("cpu")


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_the_warm_up_packs_every_model_type(model_type: str, tmp_path: Path) -> None:
    spec = write_base_checkpoint(tmp_path, SyntheticBase(model_type, num_experts=4))
    fresh: list[int] = []
    memory = HostPool(64 << 20, CPU, on_fresh=fresh.append)
    seconds = warm_up_packing(PackSettings(spec, model_type, 4, torch.float32, CPU), memory)
    assert seconds > 0 and not fresh
    assert memory.reserved_bytes > 0 and memory.used_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_warm_up_packs_on_the_gpu(tmp_path: Path) -> None:
    spec = write_base_checkpoint(tmp_path, SyntheticBase("qwen3_moe", num_experts=8))
    cuda = torch.device("cuda")
    memory = HostPool(64 << 20, cuda)
    warm_up_packing(PackSettings(spec, "qwen3_moe", 4, torch.bfloat16, cuda), memory)
    assert memory.reserved_bytes > 0 and memory.used_bytes == 0
