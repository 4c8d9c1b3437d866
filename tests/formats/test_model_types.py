"""The model-type table is complete and the only place that knows a model type's facts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.types import Activation, RouterKind
from moelora.client.model_types import (
    MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    ExpertActivation,
    ExpertLayout,
    RouterStyle,
)
from tests.formats.test_model_spec import EXPECTED

ROOT = Path(__file__).resolve().parents[2]
#: Modules that once branched on the type's name and now read the table.
CONSUMERS = (
    "moelora/client/model_spec.py",
    "shared/adapter_format.py",
    "executor_service/model_loader.py",
    "executor_service/packer.py",
    "executor_service/synthetic.py",
    "tests/formats/hf_models.py",
    "tests/formats/peft_adapters.py",
)
#: A comparison of a model type against a name or a set of names.
_BRANCH = re.compile(r"model_type\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[{]")


def test_table_is_keyed_by_name() -> None:
    assert tuple(MODEL_TYPES) == SUPPORTED_MODEL_TYPES
    assert all(name == kind.name for name, kind in MODEL_TYPES.items())


def test_every_type_has_a_test_row_and_a_doc_row() -> None:
    assert set(EXPECTED) == set(SUPPORTED_MODEL_TYPES)
    docs = (ROOT / "docs/adapter-formats.md").read_text()
    for name in SUPPORTED_MODEL_TYPES:
        assert re.search(rf"^\| {name} +\|", docs, re.MULTILINE), f"docs lack a row for {name}"


def test_kernel_enums_cover_the_table() -> None:
    """model_loader maps RouterStyle / ExpertActivation to the kernels' enums by name."""
    assert {s.name for s in RouterStyle} <= {k.name for k in RouterKind}
    assert {a.name for a in ExpertActivation} <= {k.name for k in Activation}


@pytest.mark.parametrize("name", SUPPORTED_MODEL_TYPES)
def test_entry_is_consistent(name: str) -> None:
    kind = MODEL_TYPES[name]
    fused_only = kind.saved_layout is ExpertLayout.FUSED_TRANSPOSED
    # Biases and interleaving exist only in the fused-transposed layout's tensors.
    assert not (kind.expert_biases or kind.gate_up_interleaved) or fused_only
    assert not kind.score_correction_bias or kind.grouped_routing
    assert kind.saved_layout is not ExpertLayout.FUSED
    assert kind.per_expert_module in kind.peft_2d_modules or not kind.peft_2d_modules
    assert len(set(kind.projections)) == 3
    assert kind.experts_key in kind.experts_keys
    assert not kind.norm_topk_default or not kind.always_renormalize


@pytest.mark.parametrize("path", CONSUMERS)
def test_consumers_read_the_table(path: str) -> None:
    source = (ROOT / path).read_text()
    assert _BRANCH.search(source) is None, f"{path} branches on a model type's name"
    for name in SUPPORTED_MODEL_TYPES:
        assert f'"{name}"' not in source or path.startswith("tests/"), f"{path} names {name}"
    assert re.search(r"MODEL_TYPES|spec\.type\b", source), f"{path} does not read the table"


def test_the_check_catches_a_branch() -> None:
    assert _BRANCH.search('if spec.model_type == "gpt_oss":')
    assert _BRANCH.search('kind in ("a", "b")') is None
    assert _BRANCH.search("if model_type in ('qwen2_moe', 'qwen3_moe'):")
