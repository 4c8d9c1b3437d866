"""PEFT / transformers parity: the loaded base layers and packed adapters, run through
``kernels.moe_forward(backend="torch")``, reproduce the transformers MoE block's output.

Tolerance (float32 everywhere): max |ours - reference| <= 2e-5 · max |reference|. Both sides do
the same float32 math in a different order; observed errors are ~1e-7 relative, while a wrong
layout, order or scaling gives errors of order 1.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor_service.model_loader import load_base_model
from kernels import moe_forward
from tests.formats.conftest import HFCheckpoint
from tests.formats.hf_models import HIDDEN, MODEL_TYPES, moe_block, run_block

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
