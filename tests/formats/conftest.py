"""Session-wide tiny transformers checkpoints (built once, shared by the format tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from tests.formats.hf_models import build_model, save_model


@dataclass(frozen=True)
class HFCheckpoint:
    model: PreTrainedModel
    folder: Path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], HFCheckpoint]:
    """model_type → a tiny random model and the folder transformers saved it to."""
    cache: dict[str, HFCheckpoint] = {}

    def get(model_type: str) -> HFCheckpoint:
        if model_type not in cache:
            model = build_model(model_type)
            folder = save_model(model, tmp_path_factory.mktemp(model_type))
            cache[model_type] = HFCheckpoint(model, folder)
        return cache[model_type]

    return get
