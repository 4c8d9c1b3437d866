"""Where launch configurations come from: model shapes, the on-disk cache, the selection
order, the heuristic and the autotuner's search (with a cost function standing in for the
GPU timer, which only a GPU has; tests/kernels/test_gpu.py autotunes for real)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels.autotune import (
    BUCKETS,
    CellInputs,
    block_m_options,
    confirmed,
    decode_candidate,
    precompile_set,
    search,
    tile_spaces,
)
from kernels.compile_pool import CompileJob, compile_job
from kernels.config_cache import ConfigCache
from kernels.config_select import AUTOTUNED, HEURISTIC, TABLE, ConfigSelector
from kernels.configs import (
    SMEM_BUDGET,
    GemmConfig,
    MoEConfig,
    fit_stages,
    load_table,
    padded_rank,
    parse_table_key,
    segments_per_pass,
    table_key,
)
from kernels.heuristic import (
    FP8_SHRINK_PARTS,
    FP8_STREAMING_W13,
    decode_pays,
    heuristic_config,
)
from kernels.model_shape import LayerShape, shape_from_checkpoint, shape_from_config
from kernels.reference import moe_forward_reference
from kernels.synthetic import random_layer, relative_error
from kernels.types import Activation

from .conftest import DEVICE, TOLERANCE

H100 = "NVIDIA_H100_80GB_HBM3"
QWEN3 = LayerShape(128, 2048, 768, 8)

CONFIGS = {
    "qwen3_moe": ({"moe_intermediate_size": 768, "intermediate_size": 6144,
                   "num_experts": 128}, LayerShape(128, 2048, 768, 8)),
    "qwen2_moe": ({"moe_intermediate_size": 1408, "intermediate_size": 5632,
                   "num_experts": 60}, LayerShape(60, 2048, 1408, 8)),
    "deepseek_v3": ({"moe_intermediate_size": 2048, "intermediate_size": 18432,
                     "n_routed_experts": 256}, LayerShape(256, 2048, 2048, 8)),
    "mixtral": ({"intermediate_size": 14336, "num_local_experts": 8},
                LayerShape(8, 2048, 14336, 8)),
    "gpt_oss": ({"intermediate_size": 2880, "num_local_experts": 32},
                LayerShape(32, 2048, 2880, 8)),
    "olmoe": ({"intermediate_size": 1024, "num_experts": 64}, LayerShape(64, 2048, 1024, 8)),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_shape_from_config_each_model_type(model_type: str, tmp_path: Path) -> None:
    fields, expected = CONFIGS[model_type]
    config = {"model_type": model_type, "hidden_size": 2048, "num_experts_per_tok": 8, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = shape_from_checkpoint(tmp_path)
    assert (shape.experts, shape.hidden, shape.inter, shape.top_k) == (
        expected.experts, expected.hidden, expected.inter, expected.top_k,
    )  # fmt: skip
    assert shape.name == tmp_path.name


def test_shape_from_config_rejects() -> None:
    with pytest.raises(ValueError, match="model_type 'llama'"):
        shape_from_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks"):
        shape_from_config({"model_type": "mixtral", "hidden_size": 8})
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        shape_from_config(
            {"model_type": "olmoe", "num_experts": 8, "hidden_size": 0, "intermediate_size": 8}
        )


def _config(block_m: int) -> MoEConfig:
    return dataclasses.replace(heuristic_config(64, 128, 2048, 768, 8), block_m=block_m)


def test_cache_roundtrip_keyed_by_gpu_triton_shape_rank(tmp_path: Path) -> None:
    cache = ConfigCache(tmp_path, triton_version="9.9")
    cache.store("GPU_A", QWEN3, 16, {1: _config(16), 64: _config(32)})
    cache.store("GPU_A", QWEN3, 0, {1: _config(64)})
    cache.store("GPU_A", QWEN3, 16, {4096: _config(128)})  # merges
    assert cache.load("GPU_A", QWEN3) == {
        16: {1: _config(16), 64: _config(32), 4096: _config(128)},
        0: {1: _config(64)},
    }
    assert cache.path("GPU_A", QWEN3).parent.name == "triton-9.9"
    assert cache.load("GPU_B", QWEN3) == {}
    assert ConfigCache(tmp_path, triton_version="10.0").load("GPU_A", QWEN3) == {}
    assert cache.load("GPU_A", LayerShape(128, 2048, 768, 4)) == {}
    cache.path("GPU_A", QWEN3).write_text("{not json")  # damaged: tuned again, not fatal
    assert cache.load("GPU_A", QWEN3) == {}


def test_selection_order(tmp_path: Path) -> None:
    bf16 = torch.bfloat16
    shipped = load_table(H100)
    assert shipped, "the H100 table ships with the package"
    cache = ConfigCache(tmp_path)
    selector = ConfigSelector(H100, cache)
    # The shipped table wins, at the nearest tuned token count.
    chosen = selector.select(50, QWEN3, 16, bf16)
    assert chosen.source == TABLE
    assert chosen.config.block_m == shipped["E=128,H=2048,I=768,k=8,r=16"][64].block_m
    # Another rank of a tabled shape: the nearest tuned rank's table (not the heuristic).
    assert selector.select(64, QWEN3, 48, bf16).source == f"{TABLE} (rank 64)"
    assert selector.source(QWEN3, 32) == f"{TABLE} (rank 16)"  # a tie goes to the smaller
    assert selector.source(QWEN3, 8) == f"{TABLE} (rank 16)"
    # An untabled shape: the heuristic until the cache has it.
    other = LayerShape(60, 2048, 1408, 4)
    assert selector.source(other, 16) == HEURISTIC
    cache.store(H100, other, 16, {1: _config(16), 512: _config(64)})
    fresh = ConfigSelector(H100, cache)
    assert fresh.select(300, other, 16, bf16) == dataclasses.replace(
        fresh.select(512, other, 16, bf16)
    )
    assert fresh.source(other, 16) == AUTOTUNED
    assert fresh.source(other, 0) == f"{AUTOTUNED} (rank 16)"
    # Added in process (start-up autotuning) counts as autotuned, and without tables too.
    bare = ConfigSelector(H100, cache, use_tables=False)
    assert bare.source(QWEN3, 16) == HEURISTIC
    bare.add(QWEN3, 16, {8: _config(32)})
    assert bare.select(8, QWEN3, 16, bf16).source == AUTOTUNED
    assert bare.select(8, QWEN3, 16, bf16).config.block_m == 32


@pytest.mark.parametrize(
    ("tokens", "shape"),
    list(itertools.product(BUCKETS, [
        QWEN3, LayerShape(8, 6144, 16384, 2), LayerShape(256, 7168, 2048, 8),
        LayerShape(16, 5120, 8192, 1),
    ])),
)  # fmt: skip
def test_heuristic_fits_shared_memory(tokens: int, shape: LayerShape) -> None:
    for elem_size, rank in ((2, 16), (2, 64), (4, 16)):
        config = (
            ConfigSelector("cpu")
            .select(tokens, shape, rank, torch.float32 if elem_size == 4 else torch.bfloat16)
            .config
        )
        rp = padded_rank(rank)
        lora_cols = segments_per_pass(config.lora_segments, rp) * rp
        for gemm, rows in ((config.w13, 2 * config.w13.block_n), (config.w2, config.w2.block_n)):
            extra = lora_cols if gemm.fused_shrink else 0
            per_stage = (config.block_m + rows + extra) * gemm.block_k * elem_size
            assert gemm.num_stages == 2 or gemm.num_stages * per_stage <= SMEM_BUDGET
        rows_per_expert = tokens * shape.top_k / shape.experts
        assert config.block_m == 16 or rows_per_expert > 12


def _cost(config: MoEConfig) -> float:
    """A made-up cost with its minimum inside the search space (not at the start)."""
    return (
        abs(config.block_m - 32) + abs(config.w13.block_n - 64) + abs(config.w2.block_n - 32)
        + (0 if config.atomic_sum else 5) + abs(config.lora_segments - 2)
    )  # fmt: skip


def test_search_finds_the_minimum_of_its_space() -> None:
    start = heuristic_config(64, 8, 4096, 14336, 2)
    timed: list[MoEConfig] = []

    def time_us(config: MoEConfig) -> float:
        timed.append(config)
        return _cost(config)

    best = search(time_us, start, 16.0, 16, deadline=time.monotonic() + 60)
    assert _cost(best) == min(map(_cost, timed)) < _cost(start)
    # Where each GEMM's shrink runs is a knob of its own, the separate one in K parts too.
    assert {c.w13.fused_shrink for c in timed} == {c.w2.fused_shrink for c in timed} == {0, 1}
    assert {c.w13.shrink_split_k for c in timed if not c.w13.fused_shrink} == {1, 4, 8}
    assert {c.w13.shrink_split_k for c in timed if c.w13.fused_shrink} == {1}
    assert best.block_m == 32 and best.w13.block_n == 64 and best.w2.block_n == 32
    _assert_precompiled(timed, start, 16.0)


def _kernel(gemm: GemmConfig) -> GemmConfig:
    """What selects a compiled kernel, less what the search leaves to compile while timing
    (the launch order and persistent programs, searched last); the stages are fitted at
    launch."""
    return dataclasses.replace(gemm, num_stages=0, persistent=0, group_m=0, shrink_split_k=1)


def _assert_precompiled(timed: list[MoEConfig], start: MoEConfig, rows_per_expert: float) -> None:
    """Every kernel the search launched was compiled ahead by the precompile set, but for
    those with the LoRA shrink moved (two variants, compiled while timing)."""
    covered = precompile_set(start, rows_per_expert, 16)
    w13s = {(c.block_m, _kernel(c.w13)) for c in covered}
    w2s = {(c.block_m, _kernel(c.w2)) for c in covered}
    for config in timed:
        shrinks = (config.w13.fused_shrink, config.w2.fused_shrink)
        if shrinks == (start.w13.fused_shrink, start.w2.fused_shrink):
            assert (config.block_m, _kernel(config.w13)) in w13s
            assert (config.block_m, _kernel(config.w2)) in w2s


def test_search_tries_persistent_programs_and_split_k() -> None:
    """Tensor-core tiles: persistent programs per GEMM; streaming tiles with the atomic sum:
    w2's split K. Each wins here where its made-up cost says so."""
    start = heuristic_config(4096, 128, 2048, 768, 8)
    timed: list[MoEConfig] = []

    def persistent_w2_wins(config: MoEConfig) -> float:
        timed.append(config)
        return _cost(config) - 3 * min(config.w2.persistent, 1) - config.w2.split_k

    best = search(persistent_w2_wins, start, 256.0, 16, deadline=time.monotonic() + 60)
    assert best.w2.persistent > 0 and best.w13.persistent == 0
    assert {c.w13.persistent for c in timed} == {0, 1, 2}
    assert {c.w2.split_k for c in timed} == {1}
    _assert_precompiled(timed, start, 256.0)
    timed.clear()
    start = heuristic_config(8, 128, 2048, 768, 8)
    best = search(persistent_w2_wins, start, 0.5, 16, deadline=time.monotonic() + 60)
    assert best.w2.split_k == 4 and best.atomic_sum
    assert {c.w2.persistent for c in timed} == {0}
    covered = precompile_set(start, 0.5, 16)
    assert {c.w2.split_k for c in covered} == {1, 2, 4}
    assert all(c.atomic_sum for c in covered if c.w2.split_k > 1)


def test_search_tries_the_hopper_kernels_per_gemm_where_asked() -> None:
    """With ``hopper`` the search tries each GEMM on the Triton kernel, the Hopper kernel and
    the Hopper kernel taking turns (every pairing), in blocks of 128 rows, and keeps one where
    its made-up cost says so; without it, or with streaming tiles (few rows per expert), it
    never tries them."""
    timed: list[MoEConfig] = []

    def w2_taking_turns_wins(config: MoEConfig) -> float:
        timed.append(config)
        return _cost(config) - 100 * config.w2.hopper - 50 * config.w2.pingpong

    start = heuristic_config(4096, 8, 4096, 14336, 2)
    deadline = time.monotonic() + 60
    best = search(w2_taking_turns_wins, start, 1024.0, 16, deadline, hopper=True)
    assert best.w2.hopper and best.w2.pingpong and not best.w13.hopper and best.block_m == 128
    kernels = {(False, False), (True, False), (True, True)}  # (hopper, pingpong)
    tried = {((c.w13.hopper, c.w13.pingpong), (c.w2.hopper, c.w2.pingpong)) for c in timed}
    assert tried == {(w13, w2) for w13 in kernels for w2 in kernels}
    assert all(c.block_m == 128 for c in timed if c.w13.hopper or c.w2.hopper)
    for rows_per_expert, hopper in ((1024.0, False), (0.5, True)):
        timed.clear()
        start = heuristic_config(int(rows_per_expert * 4), 8, 4096, 14336, 2)
        deadline = time.monotonic() + 60
        search(w2_taking_turns_wins, start, rows_per_expert, 16, deadline, hopper=hopper)
        assert not any(c.w13.hopper or c.w2.hopper for c in timed)
        assert not any(c.w13.pingpong or c.w2.pingpong for c in timed)


def test_search_tries_both_fp8_main_loops_for_fp8_experts_only() -> None:
    """FP8 experts: each GEMM's tiles (the FP8 ones too) are tried in both W8A16 main loops
    (scale the product, or dequantise the tile), and the precompile set covers both; a start
    that quantises activations keeps doing so; bf16 experts never see either."""
    start = heuristic_config(4096, 128, 2048, 768, 8, fp8=True)
    timed: list[MoEConfig] = []

    def w13_dequant_wins(config: MoEConfig) -> float:
        timed.append(config)
        return _cost(config) - 3 * config.w13.fp8_dequant

    best = search(w13_dequant_wins, start, 256.0, 16, deadline=time.monotonic() + 60, fp8=True)
    assert best.w13.fp8_dequant and not best.w2.fp8_dequant
    assert {c.w2.fp8_dequant for c in timed} == {False, True}
    w13_space, _ = tile_spaces(start.block_m, start.w13.group_m, fp8=True)
    assert len(w13_space) > len(tile_spaces(start.block_m, start.w13.group_m)[0])
    tried = {(c.w13.block_n, c.w13.num_warps, c.w13.fp8_dequant) for c in timed}
    for tile in w13_space:
        assert {(tile.block_n, tile.num_warps, d) for d in (False, True)} <= tried, tile
    timed.clear()
    w8a8 = start.each_gemm(fp8_activations=True)
    search(w13_dequant_wins, w8a8, 256.0, 16, deadline=time.monotonic() + 60, fp8=True)
    assert len(timed) > 10
    assert all(c.w13.fp8_activations and c.w2.fp8_activations for c in timed)
    assert all(c.w13.fp8_activations for c in precompile_set(w8a8, 256.0, 16, fp8=True))
    covered = precompile_set(start, 256.0, 16, fp8=True)
    assert {(c.w13.fp8_dequant, c.w2.fp8_dequant) for c in covered} == {
        (False, False),
        (True, True),
    }
    timed.clear()
    bf16 = heuristic_config(4096, 128, 2048, 768, 8)
    search(w13_dequant_wins, bf16, 256.0, 16, deadline=time.monotonic() + 60)
    assert not any(c.w13.fp8_dequant or c.w2.fp8_dequant for c in timed)
    assert not any(c.w13.fp8_dequant for c in precompile_set(bf16, 256.0, 16))


def test_search_stops_at_its_deadline() -> None:
    start = heuristic_config(4096, 128, 2048, 768, 8)
    calls = 0

    def slow(config: MoEConfig) -> float:
        nonlocal calls
        calls += 1
        time.sleep(0.05)
        return _cost(config)

    began = time.monotonic()
    best = search(slow, start, 256.0, 16, deadline=began + 0.12)
    assert time.monotonic() - began < 0.5
    assert calls <= 4
    assert _cost(best) <= _cost(start)


def _timings(
    series: dict[MoEConfig, list[float]],
) -> tuple[list[MoEConfig], Callable[[MoEConfig], float]]:
    """A stand-in for ``Timer.measure``: each configuration's next timing from ``series``,
    and the order they were asked for."""
    asked: list[MoEConfig] = []
    left = {config: iter(times) for config, times in series.items()}

    def measure(config: MoEConfig) -> float:
        asked.append(config)
        return next(left[config])

    return asked, measure


def test_a_winner_of_one_timing_must_win_the_re_timings_too() -> None:
    row = heuristic_config(4096, 8, 4096, 14336, 2)
    lucky = row.each_gemm(hopper=True)  # won its one timing: 0.92 of the row; really 1.0
    better = dataclasses.replace(row, w13=dataclasses.replace(row.w13, hopper=True))
    asked, measure = _timings(
        {row: [100.0, 101.0, 99.0], lucky: [104.0, 97.0, 102.0], better: [90.0, 92.0, 140.0]}
    )
    assert confirmed(row, [lucky, better], measure) == better  # medians 100, 102, 92
    assert asked == [row, lucky, better] * 3  # in turns: a clock drift touches all alike
    _, measure = _timings({row: [100.0, 101.0, 99.0], lucky: [104.0, 97.0, 102.0]})
    assert confirmed(row, [lucky], measure) == row


def test_confirmation_keeps_the_incumbent_on_a_tie_and_times_nothing_alone() -> None:
    row = heuristic_config(1, 128, 2048, 768, 8)
    other = dataclasses.replace(row, atomic_sum=not row.atomic_sum)
    _, measure = _timings({row: [50.0] * 3, other: [50.0] * 3})
    assert confirmed(row, [other], measure) == row
    asked, measure = _timings({})
    assert confirmed(row, [row], measure) == row and confirmed(row, [], measure) == row
    assert asked == []
    _, measure = _timings({row: [math.inf] * 3, other: [60.0] * 3})  # the row cannot run
    assert confirmed(row, [other], measure) == other


def test_search_spaces_are_pruned() -> None:
    assert block_m_options(0.5) == [16]
    assert max(block_m_options(1000)) == 128
    w13, w2 = tile_spaces(128, group_m=1)
    assert all(g.group_m == 1 for g in w13 + w2)
    assert len(w13) <= 8 and len(w2) <= 8
    assert not math.isnan(_cost(heuristic_config(1, 8, 16, 16, 1)))


def test_search_tries_pair_blocks_where_pairs_are_few() -> None:
    start = heuristic_config(1, 128, 2048, 768, 8)
    assert start.decode
    timed: list[MoEConfig] = []

    def aligned_wins(config: MoEConfig) -> float:
        timed.append(config)
        return _cost(config) + (50 if config.decode else 0)

    best = search(aligned_wins, start, 1 / 16, 16, deadline=time.monotonic() + 60)
    assert not best.decode and any(c.decode for c in timed)
    covered = precompile_set(start, 1 / 16, 16)
    assert {c.decode for c in covered} == {False, True}
    # Many rows per expert: pair blocks are neither tried nor compiled.
    timed.clear()
    search(aligned_wins, heuristic_config(512, 8, 4096, 14336, 2), 128.0, 16, time.monotonic() + 60)
    assert not any(c.decode for c in timed)
    assert not any(c.decode for c in precompile_set(start, 128.0, 16))


def test_decode_only_for_few_pairs() -> None:
    assert decode_pays(1, 128, 8) and decode_pays(1, 8, 2) and not decode_pays(8, 8, 2)
    assert heuristic_config(1, 128, 2048, 768, 8).decode
    assert not heuristic_config(64, 128, 2048, 768, 8).decode
    assert decode_candidate(1.0) and not decode_candidate(1.5)
    # Ranks above the register limit keep pair blocks but take the separate shrink.
    big = fit_stages(heuristic_config(1, 128, 2048, 768, 8), 2, lora_rank=128)
    assert big.decode and not big.w13.fused_shrink and not big.w2.fused_shrink


def test_fp8_decode_and_first_buckets_dequantise_and_split_both_shrinks() -> None:
    # Measured at M = 1 on six shapes (kernels/heuristic.py); bf16 decode keeps them fused.
    for shape in ((128, 2048, 768, 8), (8, 4096, 14336, 2), (64, 2048, 1408, 6)):
        fp8 = heuristic_config(1, *shape, fp8=True)
        assert fp8.decode
        for gemm in (fp8.w13, fp8.w2):
            assert gemm.fp8_dequant and not gemm.fused_shrink
            assert gemm.shrink_split_k == FP8_SHRINK_PARTS
        bf16 = heuristic_config(1, *shape)
        assert bf16.w13.fused_shrink and bf16.w2.fused_shrink and bf16.w13.shrink_split_k == 1
    # Past decode FP8 keeps its wide streaming tiles, each dequantised, the shrinks in parts
    # while experts get a row or two.
    streaming = heuristic_config(8, 128, 2048, 768, 8, fp8=True)
    assert not streaming.decode and streaming.w13.block_n == FP8_STREAMING_W13.block_n
    assert streaming.w13.fp8_dequant and streaming.w2.fp8_dequant
    assert streaming.w13.shrink_split_k == streaming.w2.shrink_split_k == FP8_SHRINK_PARTS
    wider = heuristic_config(64, 128, 2048, 768, 8, fp8=True)
    assert wider.w13.shrink_split_k == wider.w2.shrink_split_k == 1
    assert heuristic_config(8, 128, 2048, 768, 8).w13.shrink_split_k == 1


def test_fp8_compute_tiles_are_those_the_tuner_chose_in_128_row_blocks() -> None:
    """The heuristic's FP8 tiles in 128-row blocks are the ones the tuner chose at M = 4096
    for every FP8 shape of the H200 table (its row of the first tuned rank)."""
    tuned = {
        shape: by_m[4096]
        for key, by_m in load_table("NVIDIA_H200").items()
        for shape, rank in [parse_table_key(key)]
        if shape.fp8 and rank > 0 and 4096 in by_m
    }
    assert len(tuned) >= 9
    for shape, row in tuned.items():
        assert row.block_m == 128, shape
        guess = heuristic_config(4096, shape.experts, shape.hidden, shape.inter, shape.top_k,
                                 fp8=True)  # fmt: skip
        assert guess.block_m == 128
        for mine, theirs in ((guess.w13, row.w13), (guess.w2, row.w2)):
            tile = (mine.block_n, mine.block_k, mine.num_warps, mine.num_stages)
            assert tile == (theirs.block_n, theirs.block_k, theirs.num_warps, theirs.num_stages)
            assert mine.fp8_dequant == theirs.fp8_dequant
    # bf16 keeps its wide 8-warp tiles there.
    assert heuristic_config(4096, 128, 2048, 768, 8).w2.num_warps == 8


def test_streaming_ends_between_34_and_48_rows_per_expert() -> None:
    # Qwen1.5-MoE at M = 512 (34 rows per expert) streams; DeepSeek-V2-Lite (48) does not.
    assert heuristic_config(512, 60, 2048, 1408, 4).block_m <= 32
    assert heuristic_config(512, 64, 2048, 1408, 6).block_m == 64
    assert heuristic_config(512, 64, 2048, 1408, 6, fp8=True).block_m == 64


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("biases", [False, True])
def test_compile_worker_launch_with_fewer_experts_is_exact(biases: bool, decode: bool) -> None:
    """A compile worker holds a few experts but aligns for the full count (so the launch has
    the timing process's block counts); the result must still be right, which shows the
    kernels it compiled are the ones the full layer runs."""
    full = random_layer(24, 64, 32, 2, dtype=torch.float32, device=DEVICE, biases=biases,
                        activation=Activation.GPT_OSS if biases else Activation.SILU)  # fmt: skip
    config = dataclasses.replace(heuristic_config(7, 24, 64, 32, 2, elem_size=4), decode=decode)
    job = CompileJob.of(full, 7, 16, 8, config)
    few = random_layer(
        4, 64, 32, 2, dtype=torch.float32, device=DEVICE, biases=biases, activation=full.activation
    )
    with_lora, base = compile_job(job, few)
    inputs = CellInputs.make(few, 7, 16, 8, few.num_experts)
    expected = moe_forward_reference(inputs.hidden, few, inputs.lora, inputs.routing)
    assert relative_error(with_lora, expected) < TOLERANCE[torch.float32]
    expected = moe_forward_reference(inputs.hidden, few, None, inputs.routing)
    assert relative_error(base, expected) < TOLERANCE[torch.float32]


def test_table_keys_round_trip_and_keep_fp8_rows_apart() -> None:
    bf16 = LayerShape(128, 2048, 768, 8)
    fp8 = dataclasses.replace(bf16, fp8=True)
    assert table_key(bf16, 16) == "E=128,H=2048,I=768,k=8,r=16"
    assert table_key(fp8, 16) == "E=128,H=2048,I=768,k=8,weights=fp8,r=16"
    for shape in (bf16, fp8):
        assert parse_table_key(table_key(shape, 16)) == (shape, 16)


def test_the_table_writer_changes_only_the_rows_that_changed(tmp_path: Path) -> None:
    """``kernels.tune.store_in_table``: a row whose configuration is unchanged keeps its text
    (fields at their defaults included), a changed one is written without its defaults, and
    both read back as the configurations stored."""
    from kernels.tune import store_in_table

    path = tmp_path / "GPU.json"
    kept, changed = (
        heuristic_config(64, 8, 4096, 14336, 2),
        heuristic_config(4096, 8, 4096, 14336, 2),
    )
    verbose = {key: dataclasses.asdict(config) for key, config in (("64", kept), ("4096", kept))}
    path.write_text(json.dumps({table_key(QWEN3, 16): verbose}))
    new = dataclasses.replace(changed, w2=dataclasses.replace(changed.w2, hopper=True))
    store_in_table(path, QWEN3, 16, {64: kept, 4096: new})
    rows = json.loads(path.read_text())[table_key(QWEN3, 16)]
    assert rows["64"] == verbose["64"]
    assert "hopper" not in rows["4096"]["w13"] and rows["4096"]["w2"]["hopper"] is True
    assert "decode" not in rows["4096"]  # False, its default
    assert MoEConfig.from_json(rows["64"]) == kept
    assert MoEConfig.from_json(rows["4096"]) == new
