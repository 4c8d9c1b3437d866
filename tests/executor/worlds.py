"""Where the executor tests' checkpoints, adapters and reference outputs are made.

A *world* is a tiny base model saved by transformers, a folder of adapters (one ``NAME/``
folder each, as ``LocalFolderSource`` reads them) made by PEFT — or, for the legacy 2D layout,
written by ``executor_service.synthetic`` and loaded by PEFT — fixed inputs per MoE layer, and
the reference outputs: the transformers MoE block run on those inputs with each adapter active
in PEFT, and without one. The formats tests' helpers build the models and adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from executor_service.synthetic import SyntheticAdapter, write_adapter
from moelora.client.model_spec import read_model_spec
from shared.adapter_format import AdapterFormat
from tests.formats.hf_models import HIDDEN, build_model, moe_block, run_block
from tests.formats.peft_adapters import load_peft_adapter, make_peft_adapter

#: Tokens of each layer's fixed input.
TOKENS = 12
#: A variant of ``tests.formats.peft_adapters.VARIANTS``, or this: a 2D per-expert adapter.
LEGACY_2D = "legacy_2d"


@dataclass(frozen=True)
class Recipe:
    """Adapter ``name`` of ``variant`` with random weights from ``seed``."""

    name: str
    variant: str = "both"
    seed: int = 1


@dataclass
class World:
    model_type: str
    checkpoint: Path
    adapter_dir: Path
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    #: layer -> (TOKENS, H) float32 input.
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    #: (adapter name or None for the base model, layer) -> (TOKENS, H) float32 output.
    reference: dict[tuple[str | None, int], torch.Tensor] = field(default_factory=dict)

    def expected(self, layer: int, segments: list[tuple[int, str | None]]) -> torch.Tensor:
        """The rows of each segment from its adapter's reference: MoE blocks treat tokens
        independently, so a mixed batch equals the per-segment references stitched."""
        rows, start = [], 0
        for count, name in segments:
            rows.append(self.reference[(name, layer)][start : start + count])
            start += count
        return torch.cat(rows)


def _run_all(model: PreTrainedModel, world: World, name: str | None) -> None:
    for layer in world.moe_layers:
        world.reference[(name, layer)] = run_block(moe_block(model, layer), world.inputs[layer])


def _make_adapter(world: World, recipe: Recipe) -> PeftModel:
    folder = world.adapter_dir / recipe.name
    if recipe.variant == LEGACY_2D:
        spec = read_model_spec(world.checkpoint)
        legacy = SyntheticAdapter(rank=3, alpha=6.0, format=AdapterFormat.PER_EXPERT)
        write_adapter(folder, spec, legacy, seed=recipe.seed)
        return load_peft_adapter(world.model_type, folder)
    model, _ = make_peft_adapter(world.model_type, recipe.variant, folder, seed=recipe.seed)
    return model


def new_world(model_type: str, checkpoint: Path, adapter_dir: Path) -> World:
    """A world over a saved checkpoint, with no inputs or references yet."""
    spec = read_model_spec(checkpoint)
    return World(
        model_type=model_type,
        checkpoint=checkpoint,
        adapter_dir=adapter_dir,
        moe_layers=spec.moe_layers,
        dense_layers=tuple(i for i in range(spec.num_layers) if i not in spec.moe_layers),
        num_experts=spec.num_experts,
        top_k=spec.top_k,
    )


def build_world(model_type: str, root: Path, recipes: list[Recipe]) -> World:
    """Saves the base checkpoint to ``root/base`` and the adapters to ``root/adapters/NAME``;
    computes every reference output in float32."""
    base = build_model(model_type)
    checkpoint = root / "base"
    base.save_pretrained(checkpoint)
    world = new_world(model_type, checkpoint, root / "adapters")
    generator = torch.Generator().manual_seed(100)
    for layer in world.moe_layers:
        world.inputs[layer] = torch.randn(TOKENS, HIDDEN, generator=generator)
    _run_all(base, world, None)
    for recipe in recipes:
        adapted = cast(PreTrainedModel, _make_adapter(world, recipe).base_model.model)
        _run_all(adapted, world, recipe.name)
    return world
