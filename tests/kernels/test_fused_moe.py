"""The Triton path against the float32 reference: edge cases of shapes, routing and LoRA.

On the CPU this runs Triton's interpreter (fp32 and fp16: the interpreter's bf16 dots are
wrong); ``test_gpu.py`` repeats the comparison in bf16 at real shapes. Every run allocates
from a poisoned ``torch.empty``, so unwritten rows show up as NaN.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from kernels import align
from kernels import fused_moe as fused_moe_kernels
from kernels.configs import GemmConfig, MoEConfig
from kernels.forward import fused_moe, moe_forward
from kernels.reference import moe_forward_reference
from kernels.routing import route
from kernels.synthetic import (
    lora_context,
    random_hidden,
    random_layer,
    random_slots,
    random_token_slots,
    relative_error,
)
from kernels.types import (
    Activation,
    LoRAContext,
    MoELayerWeights,
    RouterKind,
    RouterSpec,
    Routing,
)

from .conftest import DEVICE, TOLERANCE

pytestmark = pytest.mark.usefixtures("poison_allocations")


@dataclass(frozen=True)
class Case:
    tokens: int = 24
    experts: int = 6
    hidden: int = 64
    inter: int = 32
    top_k: int = 2
    dtype: torch.dtype = torch.float32
    slots: int = 4
    rank: int = 8
    enabled: tuple[bool, ...] | None = None
    token_slots: tuple[int, ...] | None = None  # default: random, -1 included
    router: RouterSpec | None = None
    activation: Activation = Activation.SILU
    biases: bool = False
    shared_inter: int = 0
    shared_gate: bool = False
    all_on_expert: int | None = None  # precomputed routing: every pair on this expert
    block_m: int = 16
    segments: int = 2
    w13: tuple[int, int, int] = (16, 32, 1)  # block_n, block_k, tiles_per_program
    w2: tuple[int, int, int] = (32, 32, 1)
    fused_shrink: tuple[bool, bool] = (False, False)  # w13, w2
    group_m: tuple[int, int] = (0, 0)  # w13, w2
    single_program_align: bool = True
    hidden_scale: float = 1.0
    decode: bool = False
    w2_tma: bool = False
    w13_tma: bool = False
    split_k: int = 1  # w2's (with the atomic sum)
    shrink_split_k: tuple[int, int] = (1, 1)  # w13, w2: K parts of the separate shrink
    persistent: tuple[int, int] = (0, 0)  # w13, w2: programs per multiprocessor (here 2)
    extra: dict[str, object] = field(default_factory=dict)

    def config(self, atomic_sum: bool) -> MoEConfig:
        return MoEConfig(
            block_m=self.block_m,
            lora_segments=self.segments,
            w13=GemmConfig(
                *self.w13,
                num_warps=4,
                num_stages=2,
                group_m=self.group_m[0],
                fused_shrink=self.fused_shrink[0],
                tma=self.w13_tma,
                persistent=self.persistent[0],
                shrink_split_k=self.shrink_split_k[0],
            ),
            w2=GemmConfig(
                *self.w2,
                num_warps=4,
                num_stages=2,
                group_m=self.group_m[1],
                fused_shrink=self.fused_shrink[1],
                tma=self.w2_tma,
                split_k=self.split_k,
                persistent=self.persistent[1],
                shrink_split_k=self.shrink_split_k[1],
            ),
            atomic_sum=atomic_sum,
            decode=self.decode,
        )


CASES = {
    "one_token": Case(tokens=1),
    "tokens_not_multiple_of_block_m_odd_shapes_fp16": Case(
        tokens=37, experts=7, inter=48, top_k=4, dtype=torch.float16, rank=16, w13=(16, 32, 2)
    ),
    "top_k_1_rank_4": Case(tokens=20, experts=5, top_k=1, rank=4),
    "top_k_8_fp16": Case(
        tokens=12, experts=10, top_k=8, dtype=torch.float16, rank=16, block_m=32, segments=4
    ),
    "rank_64_fp16": Case(tokens=16, experts=4, rank=64, dtype=torch.float16, segments=1),
    "more_segments_than_a_pass_holds": Case(
        tokens=40, experts=3, slots=8, rank=8, block_m=64, segments=1
    ),
    "empty_and_disabled_slots": Case(
        slots=6,
        enabled=(True, True, False, True, True, True),
        token_slots=(0, 2, 5, 2, 0, 5) * 4,
    ),
    "no_token_has_an_adapter": Case(token_slots=(-1,) * 24),
    "every_token_on_one_expert": Case(tokens=50, top_k=1, all_on_expert=2),
    "gpt_oss_activation_biases_router": Case(
        router=RouterSpec(RouterKind.TOPK_SOFTMAX, top_k=4, renormalize=True),
        top_k=4,
        activation=Activation.GPT_OSS,
        biases=True,
        hidden_scale=4.0,
    ),
    "qwen2_shared_expert_with_gate_fp16": Case(
        dtype=torch.float16, shared_inter=48, shared_gate=True, top_k=4
    ),
    "deepseek_grouped_router_shared_expert": Case(
        experts=8,
        top_k=3,
        router=RouterSpec(RouterKind.SIGMOID_GROUPED_TOPK, 3, True, 4, 2, 2.5),
        shared_inter=32,
    ),
    "k_not_multiple_of_block_k": Case(hidden=96, inter=40, w13=(16, 64, 1), w2=(32, 32, 1)),
    "multi_program_alignment_fp16": Case(
        tokens=150, experts=5, dtype=torch.float16, single_program_align=False, block_m=32
    ),
    "all_tiles_in_one_program": Case(inter=64, w13=(16, 32, 8), w2=(16, 32, 8), rank=16),
    # The LoRA shrink inside the GEMMs' main loops (GemmConfig.fused_shrink).
    "fused_shrink_one_token": Case(tokens=1, fused_shrink=(True, True), segments=1),
    "fused_shrink_w13_only_fp16": Case(
        tokens=37, experts=7, top_k=4, dtype=torch.float16, rank=16, fused_shrink=(True, False)
    ),
    "fused_shrink_w2_only_k_not_multiple_of_block_k": Case(
        hidden=96, inter=40, w13=(16, 64, 1), w2=(32, 32, 1), fused_shrink=(False, True)
    ),
    "fused_shrink_more_segments_than_a_pass_holds": Case(
        tokens=40, experts=3, slots=8, rank=8, block_m=64, segments=1, fused_shrink=(True, True)
    ),
    "fused_shrink_rank_64_several_tiles_per_program_fp16": Case(
        tokens=16,
        experts=4,
        rank=64,
        dtype=torch.float16,
        segments=4,
        inter=64,
        w13=(16, 32, 3),
        w2=(16, 32, 2),
        fused_shrink=(True, True),
    ),
    "fused_shrink_gpt_oss_biases_disabled_slots": Case(
        router=RouterSpec(RouterKind.TOPK_SOFTMAX, top_k=4, renormalize=True),
        top_k=4,
        activation=Activation.GPT_OSS,
        biases=True,
        hidden_scale=4.0,
        slots=6,
        enabled=(True, True, False, True, True, True),
        fused_shrink=(True, True),
    ),
    # Ranks above 64: the shrink and the expand go 64 ranks at a time (a fused shrink asked
    # for falls back to the separate one), several segments per block.
    "rank_96_in_two_chunks_fp16": Case(
        tokens=24, experts=3, slots=5, rank=96, dtype=torch.float16, segments=4, block_m=32
    ),
    "rank_200_fused_shrink_falls_back": Case(
        tokens=12, experts=2, slots=3, rank=200, segments=2, fused_shrink=(True, True)
    ),
    # A 128-row block: the separate shrink runs a program per 64 rows.
    "block_of_128_rows_in_two_shrink_programs": Case(
        tokens=80, experts=2, top_k=2, slots=6, block_m=128, segments=4
    ),
    # w2's weights through a TMA tensor descriptor (the interpreter emulates the copy engine).
    "w2_weights_by_tma_fp16": Case(tokens=37, experts=7, top_k=4, dtype=torch.float16, w2_tma=True),
    "w2_tma_k_and_n_not_multiples_fused_shrink": Case(
        hidden=96,
        inter=40,
        w13=(16, 64, 1),
        w2=(64, 32, 2),
        fused_shrink=(False, True),
        w2_tma=True,
    ),
    # w13's gate and up rows in one box of W13 seen as (E, 2, I, H); I not a multiple of the
    # tile, so the last box reads zeros past I (not the up rows).
    "w13_and_w2_by_tma_fp16": Case(
        tokens=37,
        experts=7,
        top_k=4,
        inter=40,
        dtype=torch.float16,
        w13=(16, 32, 2),
        w13_tma=True,
        w2_tma=True,
    ),
    "w13_tma_fused_shrink_gpt_oss_biases": Case(
        router=RouterSpec(RouterKind.TOPK_SOFTMAX, top_k=4, renormalize=True),
        top_k=4,
        activation=Activation.GPT_OSS,
        biases=True,
        hidden_scale=4.0,
        inter=48,
        fused_shrink=(True, True),
        w13_tma=True,
    ),
    # Rows of 12 bytes cannot be described: pointer loads take over, same result.
    "w2_tma_unaligned_rows_fall_back_fp16": Case(inter=6, dtype=torch.float16, w2_tma=True),
    # w2's reduction cut into parts that add into the atomic sum (GemmConfig.split_k):
    # even parts; an uneven last part with the fused shrink (each part expands its share),
    # biases (the first part adds them) and TMA; more parts asked than K steps.
    "w2_split_k_fp16": Case(
        tokens=37, experts=7, top_k=4, inter=96, dtype=torch.float16, w2=(32, 32, 1), split_k=3
    ),
    "w2_split_k_uneven_fused_shrink_biases_tma": Case(
        router=RouterSpec(RouterKind.TOPK_SOFTMAX, top_k=4, renormalize=True),
        top_k=4,
        activation=Activation.GPT_OSS,
        biases=True,
        hidden_scale=4.0,
        inter=80,
        w2=(32, 32, 2),
        fused_shrink=(True, True),
        w2_tma=True,
        split_k=2,
    ),
    "w2_split_k_separate_shrink_more_parts_than_steps": Case(
        inter=40, rank=16, w2=(32, 32, 1), split_k=4
    ),
    # The separate shrink's K cut into parts that add into x·Aᵀ (GemmConfig.shrink_split_k):
    # H = 200 in four parts of 64 (fp32 steps; the last 8 wide), I = 80 in two; in fp16 with
    # rank 16 two parts of 128 each (the second 72 and 16 wide).
    "separate_shrink_split_over_k_decode": Case(
        tokens=3, hidden=200, inter=80, decode=True, shrink_split_k=(4, 3)
    ),
    "separate_shrink_split_over_k_fp16_rank_16": Case(
        tokens=37,
        experts=7,
        top_k=4,
        hidden=200,
        inter=144,
        dtype=torch.float16,
        rank=16,
        shrink_split_k=(3, 2),
    ),
    # Persistent programs (the interpreter has 2 multiprocessors): each loops over several
    # (block, N program) pieces of work, padding blocks among them; with TMA, the fused
    # shrink, several tiles per program, split K, and the grouped launch order.
    "persistent_programs_fp16": Case(
        tokens=37, experts=7, top_k=4, dtype=torch.float16, persistent=(1, 2), w13_tma=True
    ),
    "persistent_fused_shrink_tiles_split_k_grouped": Case(
        tokens=40,
        experts=5,
        inter=64,
        w13=(16, 32, 2),
        w2=(16, 32, 2),
        fused_shrink=(True, True),
        group_m=(2, 3),
        split_k=2,
        persistent=(3, 1),
        w2_tma=True,
    ),
    # Launch order: groups of M blocks (GemmConfig.group_m), a last group cut short.
    "grouped_launch_order_fp16": Case(
        tokens=150,
        experts=5,
        dtype=torch.float16,
        block_m=16,
        inter=64,
        w13=(16, 32, 2),
        w2=(16, 32, 1),
        group_m=(3, 1),
    ),
    "grouped_launch_order_fused_shrink": Case(
        tokens=60,
        experts=5,
        inter=64,
        w13=(16, 32, 1),
        w2=(16, 32, 4),
        group_m=(4, 2),
        fused_shrink=(True, True),
    ),
}


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, MoELayerWeights, LoRAContext, Routing]:
    router = case.router or RouterSpec(RouterKind.SOFTMAX_TOPK, case.top_k, True)
    layer = random_layer(
        case.experts, case.hidden, case.inter, case.top_k, dtype=case.dtype, device=DEVICE,
        seed=seed, router=router, activation=case.activation, biases=case.biases,
        shared_inter=case.shared_inter, shared_gate=case.shared_gate,
    )  # fmt: skip
    hidden = random_hidden(case.tokens, case.hidden, dtype=case.dtype, device=DEVICE, seed=seed + 1)
    hidden = hidden * case.hidden_scale
    enabled = list(case.enabled) if case.enabled else None
    slots = random_slots(layer, case.slots, case.rank, seed=seed + 2, enabled=enabled)
    if case.token_slots is not None:
        token_slots = torch.tensor(case.token_slots, dtype=torch.int32)
    else:
        token_slots = random_token_slots(case.tokens, case.slots, seed=seed + 3)
    lora = lora_context(slots, token_slots)
    if case.all_on_expert is not None:
        ids = torch.full((case.tokens, case.top_k), case.all_on_expert, dtype=torch.int32)
        weights = torch.rand(case.tokens, case.top_k) + 0.5
        routing = Routing(ids.to(DEVICE), weights.to(DEVICE))
    else:
        routing = route(hidden, layer)
    return hidden, layer, lora, routing


@pytest.mark.parametrize("atomic_sum", [True, False], ids=["atomic_sum", "sum_pass"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_reference(
    name: str, atomic_sum: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    if not case.single_program_align:
        monkeypatch.setattr(align, "SINGLE_PROGRAM_MAX_PAIRS", 0)
    hidden, layer, lora, routing = _inputs(case, seed=7)
    tol = TOLERANCE[case.dtype]
    expected = {}
    for context in (lora, None):
        expected[context is not None] = moe_forward_reference(hidden, layer, context, routing)
        got = fused_moe(hidden, layer, context, routing, case.config(atomic_sum))
        assert got.dtype == hidden.dtype and got.shape == hidden.shape
        err = relative_error(got, expected[context is not None])
        assert err < tol, f"{name} lora={context is not None}: rel err {err:.2e} ≥ {tol:.0e}"
    active = (lora.token_slots >= 0) & (lora.slots.enabled[lora.token_slots.clamp(min=0)] != 0)
    if active.any():
        # The adapters must change the result, else the test would not see them dropped.
        assert relative_error(expected[False], expected[True]) > 10 * tol


#: Cases that pair blocks (``MoEConfig.decode``: no alignment, a block per pair) must meet too.
DECODE_CASES = [
    "one_token",
    "tokens_not_multiple_of_block_m_odd_shapes_fp16",
    "top_k_1_rank_4",
    "top_k_8_fp16",
    "rank_64_fp16",
    "rank_96_in_two_chunks_fp16",
    "empty_and_disabled_slots",
    "no_token_has_an_adapter",
    "every_token_on_one_expert",
    "gpt_oss_activation_biases_router",
    "qwen2_shared_expert_with_gate_fp16",
    "deepseek_grouped_router_shared_expert",
    "k_not_multiple_of_block_k",
    "fused_shrink_one_token",
    "fused_shrink_gpt_oss_biases_disabled_slots",
    "w2_weights_by_tma_fp16",
    "w2_split_k_fp16",
    "w2_split_k_uneven_fused_shrink_biases_tma",
    "persistent_programs_fp16",
]


def _decode_case(name: str) -> Case:
    """A case cut to a decode batch (a few tokens: the interpreter runs a block per pair)."""
    case = CASES[name]
    tokens = min(case.tokens, 5)
    slots = case.token_slots[:tokens] if case.token_slots is not None else None
    return dataclasses.replace(case, tokens=tokens, token_slots=slots, decode=True)


@pytest.mark.parametrize("atomic_sum", [True, False], ids=["atomic_sum", "sum_pass"])
@pytest.mark.parametrize("name", DECODE_CASES)
def test_pair_blocks_match_reference(name: str, atomic_sum: bool) -> None:
    case = _decode_case(name)
    hidden, layer, lora, routing = _inputs(case, seed=11)
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        got = fused_moe(hidden, layer, context, routing, case.config(atomic_sum))
        assert got.dtype == hidden.dtype and got.shape == hidden.shape
        err = relative_error(got, expected)
        tol = TOLERANCE[case.dtype]
        assert err < tol, f"{name} lora={context is not None}: rel err {err:.2e} ≥ {tol:.0e}"


def test_pair_blocks_need_no_alignment_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``decode`` the alignment kernels are never called."""

    def no_alignment(*args: object, **kwargs: object) -> None:
        raise AssertionError("align_pairs called for a decode configuration")

    monkeypatch.setattr("kernels.forward.align_pairs", no_alignment)
    case = _decode_case("top_k_8_fp16")
    hidden, layer, lora, routing = _inputs(case, seed=5)
    got = fused_moe(hidden, layer, lora, routing, case.config(atomic_sum=False))
    expected = moe_forward_reference(hidden, layer, lora, routing)
    assert relative_error(got, expected) < TOLERANCE[case.dtype]


def test_weight_descriptor_only_where_the_copy_engine_is(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.zeros((2, 64, 32), dtype=torch.float16)
    tma = GemmConfig(32, 32, 1, 4, 2, tma=True)
    assert fused_moe_kernels.weight_descriptor(w, dataclasses.replace(tma, tma=False)) is None
    assert fused_moe_kernels.weight_descriptor(w[:, :, :6].contiguous(), tma) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused_moe_kernels.tma_available(torch.device("cpu"))
    assert fused_moe_kernels.weight_descriptor(w, tma) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_moe_kernels.weight_descriptor(w, tma) is not None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entry_point_across_seeds(seed: int) -> None:
    """moe_forward with its own routing and heuristic configuration."""
    case = Case(tokens=29, experts=6, top_k=2, dtype=torch.float16, rank=16)
    hidden, layer, lora, _ = _inputs(case, seed=seed)
    expected = moe_forward(hidden, layer, lora, backend="torch")
    got = moe_forward(hidden, layer, lora)
    assert relative_error(got, expected) < TOLERANCE[torch.float16]
