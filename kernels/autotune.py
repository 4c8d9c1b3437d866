"""Autotuning of the launch configurations for one layer shape and LoRA rank, in a time budget.

For every token bucket (the executor's: 1, 2, 4, …, 512 and 4096) a coordinate search starts
from the heuristic's configuration (or the previous bucket's best, whichever is faster) and
times, one knob group at a time, a pruned space: BLOCK_M, the w13 tiles, the w2 tiles (for FP8
weights more of them, each with both W8A16 main loops), then where the LoRA shrink runs (and in
how many parts over K), the segments per pass, the sum over k, the TMA loads, the launch order,
then persistent programs and w2's split K (``program_knobs``). In buckets of at most one pair
per expert, whether the alignment is folded into the GEMMs (``MoEConfig.decode``) is a knob
too, tried before the tiles. ``refine`` times only the last group around given configurations
(a shipped table made before those knobs existed). Each candidate is timed as the benchmark
times it (CUDA graph replay under do_bench, L2 flushed) on the layer itself with random hidden
states, routing and adapters. With ``jobs`` > 1 every candidate is first compiled by worker
processes (``kernels.compile_pool``), so the timing loop waits for no compiler. The budget is
shared out over the buckets still to tune; a bucket cut short keeps the best it timed. Each
bucket's best is checked against the float32 reference, and where it is not the search's
start it must beat the start again in alternating re-timings (``confirmed``): one timing of
each chose it, and a compute-bound cell's timing moves by ±5% between runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton.testing

from kernels.configs import GemmConfig, MoEConfig, fit_stages
from kernels.forward import as_run, fused_moe, layer_shape
from kernels.heuristic import heuristic_config
from kernels.hopper_gemm import BLOCK_M, GL_DTYPES, on_hopper
from kernels.model_shape import LayerShape
from kernels.reference import moe_forward_reference
from kernels.synthetic import (
    random_hidden,
    random_routing,
    random_slots,
    relative_error,
    round_robin_slots,
)
from kernels.types import LoRAContext, MoELayerWeights, Routing

#: The token buckets the executor runs (its CUDA graphs are captured for these).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 4096)
#: ‖out − ref‖/‖ref‖ a tuned configuration must meet against the float32 reference.
TOLERANCE = 2e-2
#: Distinct adapters among the tokens while timing (the benchmark's).
MAX_ADAPTERS = 4

# (block_n, block_k, tiles_per_program, num_warps, num_stages); w13's block_n is per half.
W13_STREAMING = [
    (16, 128, 1, 4, 4), (32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (16, 256, 1, 4, 3),
    (32, 256, 1, 4, 3), (32, 64, 1, 4, 6),
]  # fmt: skip
W2_STREAMING = [
    (64, 128, 1, 4, 4), (32, 128, 1, 4, 4), (128, 128, 1, 4, 3), (32, 256, 1, 4, 3),
    (64, 64, 1, 4, 6), (16, 256, 1, 4, 3),
]  # fmt: skip
W13_COMPUTE = [
    (64, 64, 1, 4, 4), (128, 64, 1, 8, 3), (64, 128, 1, 8, 3), (128, 64, 2, 8, 3),
    (64, 64, 4, 8, 3), (32, 128, 1, 4, 4),
]  # fmt: skip
W2_COMPUTE = [
    (128, 64, 1, 4, 4), (256, 64, 1, 8, 3), (128, 128, 1, 8, 3), (256, 64, 4, 8, 3),
    (128, 64, 4, 8, 4), (64, 128, 1, 4, 4),
]  # fmt: skip

#: Tiles tried besides those for FP8 weights: a byte per weight leaves shared memory for deeper
#: pipelines while streaming (decode is latency bound: bytes in flight), and for the 128-wide
#: K steps (one scale block) of tensor-core tiles.
W13_STREAMING_FP8 = [(16, 128, 1, 4, 8), (32, 128, 1, 4, 6), (64, 128, 1, 4, 6)]
W2_STREAMING_FP8 = [(64, 128, 1, 4, 6), (32, 128, 1, 4, 6), (128, 128, 1, 4, 4)]
W13_COMPUTE_FP8 = [(64, 128, 1, 4, 3), (32, 128, 1, 4, 6)]
W2_COMPUTE_FP8 = [(128, 128, 1, 4, 3), (64, 128, 1, 4, 6)]

#: Programs per multiprocessor tried for persistent launches (0: a program per tile).
PERSISTENT_OPTIONS = (0, 1, 2)
#: w2 K parts tried where the sum is atomic and the GEMMs stream weights.
SPLIT_K_OPTIONS = (1, 2, 4)
#: K parts of a separate LoRA shrink tried where the GEMMs stream weights (a decode step's
#: shrink otherwise runs one program per pair over all of K).
SHRINK_SPLIT_OPTIONS = (1, 4, 8)
#: Fresh timings of each contender that decide between a search's winner and what it would
#: replace (``confirmed``).
CONFIRM_REPEATS = 3


def decode_candidate(rows_per_expert: float) -> bool:
    """Buckets where pair blocks (``MoEConfig.decode``) may win: at most one pair per expert."""
    return rows_per_expert <= 1


def block_m_options(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 4:
        return [16]
    if rows_per_expert <= 16:
        return [16, 32]
    if rows_per_expert <= 96:
        return [16, 32, 64]
    return [64, 128]


def _streaming(block_m: int) -> bool:
    return block_m <= 32


def tile_spaces(
    block_m: int, group_m: int, fp8: bool = False
) -> tuple[list[GemmConfig], list[GemmConfig]]:
    """The (w13, w2) tiles searched for blocks of ``block_m`` rows (of FP8 weights: ``fp8``)."""
    if _streaming(block_m):
        w13, w2 = W13_STREAMING, W2_STREAMING
        if fp8:
            w13, w2 = w13 + W13_STREAMING_FP8, w2 + W2_STREAMING_FP8
        return [GemmConfig(*c) for c in w13], [GemmConfig(*c) for c in w2]
    w13, w2 = W13_COMPUTE, W2_COMPUTE
    if fp8:
        w13, w2 = w13 + W13_COMPUTE_FP8, w2 + W2_COMPUTE_FP8
    return (
        [GemmConfig(*c, group_m=group_m) for c in w13],
        [GemmConfig(*c, group_m=group_m) for c in w2],
    )


def precompile_set(
    start: MoEConfig, rows_per_expert: float, rank: int, *, fp8: bool = False
) -> list[MoEConfig]:
    """Configurations whose compilation covers every kernel the search of one bucket may
    launch: each BLOCK_M with every w13 tile paired with a w2 tile (the two GEMMs compile
    apart, so pairing them covers all their combinations), with pair blocks too where the
    bucket may use them, and each tile also through a TMA descriptor (not for FP8 experts,
    ``fp8``: they take pointer loads, and each tile with both W8A16 main loops, unless the
    start quantises activations)."""
    modes = [False, True] if decode_candidate(rows_per_expert) else [False]
    unfitted = []
    for decode, bm in itertools.product(modes, block_m_options(rows_per_expert)):
        w13_space, w2_space = tile_spaces(bm, start.w13.group_m, fp8)
        for w13, w2 in itertools.zip_longest(w13_space, w2_space):
            unfitted.append(
                dataclasses.replace(
                    start,
                    block_m=bm,
                    decode=decode,
                    w13=_retile(start.w13, w13 or start.w13),
                    w2=_retile(start.w2, w2 or start.w2),
                )
            )
    configs = [fit_stages(c, 2, rank, fp8=fp8) for c in unfitted]
    with_tma = [c.each_gemm(tma=True) for c in configs if not fp8]
    # FP8's main loops (GemmConfig.fp8_dequant) are kernel variants of their own too.
    dequant = []
    if fp8 and not start.w13.fp8_activations:
        dequant = [
            fit_stages(c.each_gemm(fp8_dequant=d), 2, rank, fp8=True)
            for c in unfitted
            for d in (False, True)
        ]
    # Split K is a kernel variant of its own (a constexpr). Persistent programs are too, but
    # they are searched last and rarely win (kernels/BENCHMARKS.md): they compile while
    # timing, if the budget gets that far, rather than double the compile set.
    split = [
        dataclasses.replace(c, atomic_sum=True, w2=dataclasses.replace(c.w2, split_k=parts))
        for c in configs
        for parts in SPLIT_K_OPTIONS[1:]
        if _streaming(c.block_m)
    ]
    return list(dict.fromkeys(configs + with_tma + dequant + split))


def _retile(gemm: GemmConfig, tile: GemmConfig) -> GemmConfig:
    """``tile`` in the FP8 main loop of ``gemm`` (its other knobs as the tile space has them)."""
    return dataclasses.replace(
        tile, fp8_dequant=gemm.fp8_dequant, fp8_activations=gemm.fp8_activations
    )


def _tile_candidates(gemm: GemmConfig, space: list[GemmConfig], fp8: bool) -> list[GemmConfig]:
    """The tiles of ``space`` for a GEMM now ``gemm``; with FP8 weights in both W8A16 main
    loops (their best tiles differ: the scaled product holds a second accumulator)."""
    tiles = [_retile(gemm, tile) for tile in space]
    if not fp8 or gemm.fp8_activations:
        return tiles
    return [dataclasses.replace(t, fp8_dequant=d) for t in tiles for d in (False, True)]


def program_knobs(best: MoEConfig, knob: str) -> list[MoEConfig]:
    """Variants of ``best`` in one knob of how programs are laid out: with tensor-core tiles
    "w13" / "w2" persistent programs per multiprocessor; with streaming tiles and the atomic
    sum "split_k", w2's K parts (measured on an H200: persistent programs won 15-20% on
    grouped GEMMs at M = 4096 and split K a few % at most at M = 1-8)."""
    if _streaming(best.block_m):
        if knob != "split_k" or not best.atomic_sum:
            return []
        return [
            dataclasses.replace(best, w2=dataclasses.replace(best.w2, split_k=parts))
            for parts in SPLIT_K_OPTIONS
        ]
    if knob == "split_k":
        return []
    if knob == "w13":
        return [
            dataclasses.replace(best, w13=dataclasses.replace(best.w13, persistent=p))
            for p in PERSISTENT_OPTIONS
        ]
    return [
        dataclasses.replace(best, w2=dataclasses.replace(best.w2, persistent=p))
        for p in PERSISTENT_OPTIONS
    ]


PROGRAM_KNOBS = ("w13", "w2", "split_k")


def hopper_knobs(best: MoEConfig) -> list[MoEConfig]:
    """``best`` with each GEMM on the Triton kernels, the Hopper kernels (``kernels.hopper_w13``,
    ``kernels.hopper_w2``) or the Hopper kernels taking turns (``GemmConfig.pingpong``), in
    their blocks of ``BLOCK_M`` rows; none for streaming tiles (few rows per expert: measured
    on an H200, the Hopper kernels win from about 128 rows per expert, by 10-15% on Mixtral at
    M = 4096, and lose below that)."""
    if _streaming(best.block_m):
        return []
    at = dataclasses.replace(best, block_m=BLOCK_M)

    def options(gemm: GemmConfig) -> list[GemmConfig]:
        return [
            dataclasses.replace(gemm, hopper=hopper, pingpong=pingpong)
            for hopper, pingpong in ((False, False), (True, False), (True, True))
        ]

    variants = [
        dataclasses.replace(at, w13=w13, w2=w2) for w13 in options(at.w13) for w2 in options(at.w2)
    ]
    return [v for v in variants if v != best]


def hopper_searched(layer: MoELayerWeights) -> bool:
    """Whether the search tries ``hopper_knobs`` for ``layer``: 16-bit experts on an sm_90 GPU."""
    return on_hopper(layer.w13.device) and layer.dtype in GL_DTYPES and not layer.fp8


def shrink_knobs(best: MoEConfig) -> list[MoEConfig]:
    """Where each GEMM's LoRA shrink runs, one GEMM at a time: fused into its main loop, or
    the separate launch, whose K is also cut into parts with streaming tiles."""
    parts = SHRINK_SPLIT_OPTIONS if _streaming(best.block_m) else (1,)

    def options(gemm: GemmConfig) -> list[GemmConfig]:
        fused = dataclasses.replace(gemm, fused_shrink=True, shrink_split_k=1)
        apart = [dataclasses.replace(gemm, fused_shrink=False, shrink_split_k=p) for p in parts]
        return [g for g in [fused, *apart] if g != gemm]

    return [dataclasses.replace(best, w13=g) for g in options(best.w13)] + [
        dataclasses.replace(best, w2=g) for g in options(best.w2)
    ]


def search(
    time_us: Callable[[MoEConfig], float],
    start: MoEConfig,
    rows_per_expert: float,
    rank: int,
    deadline: float,
    elem_size: int = 2,
    *,
    fp8: bool = False,
    hopper: bool = False,
) -> MoEConfig:
    """Coordinate search from ``start`` until done or ``time.monotonic() > deadline``;
    returns the fastest configuration timed (``start`` at least). ``elem_size``: bytes of
    the hidden states' dtype; ``fp8``: FP8 experts (``fit_stages``); ``hopper``: try the
    Hopper kernels too (``hopper_knobs``)."""
    best = start
    best_us = time_us(start)

    def consider(candidates: list[MoEConfig]) -> None:
        nonlocal best, best_us
        for config in dict.fromkeys(fit_stages(c, elem_size, rank, fp8=fp8) for c in candidates):
            if time.monotonic() > deadline:
                return
            us = time_us(config)
            if us < best_us:
                best, best_us = config, us

    consider([dataclasses.replace(best, block_m=bm) for bm in block_m_options(rows_per_expert)])
    if decode_candidate(rows_per_expert):
        consider([dataclasses.replace(best, decode=not best.decode)])
    w13_space, w2_space = tile_spaces(best.block_m, best.w13.group_m, fp8)
    consider([dataclasses.replace(best, w13=g) for g in _tile_candidates(best.w13, w13_space, fp8)])
    consider([dataclasses.replace(best, w2=g) for g in _tile_candidates(best.w2, w2_space, fp8)])
    if rank > 0:
        consider(
            shrink_knobs(best) + [dataclasses.replace(best, lora_segments=s) for s in (1, 2, 4)]
        )
    consider([dataclasses.replace(best, atomic_sum=not best.atomic_sum)])
    consider([dataclasses.replace(best, w13=dataclasses.replace(best.w13, tma=not best.w13.tma))])
    consider([dataclasses.replace(best, w2=dataclasses.replace(best.w2, tma=not best.w2.tma))])
    if not _streaming(best.block_m):
        consider([best.each_gemm(group_m=g) for g in (0, 1, 8)])
    for knob in PROGRAM_KNOBS:
        consider(program_knobs(best, knob))
    if hopper:
        consider(hopper_knobs(best))
    return best


def confirmed(
    incumbent: MoEConfig,
    challengers: Sequence[MoEConfig],
    measure: Callable[[MoEConfig], float],
    repeats: int = CONFIRM_REPEATS,
) -> MoEConfig:
    """Of ``incumbent`` and ``challengers``, the one with the lowest median of ``repeats``
    fresh timings (``measure``), taken in turns so that a drift of the GPU's clocks touches
    each alike; ``incumbent`` where it ties."""
    contenders = list(dict.fromkeys([incumbent, *challengers]))
    if len(contenders) == 1:
        return incumbent
    samples: dict[MoEConfig, list[float]] = {c: [] for c in contenders}
    for _ in range(repeats):
        for config in contenders:
            samples[config].append(measure(config))
    return min(contenders, key=lambda c: statistics.median(samples[c]))


@dataclass
class CellInputs:
    """Random inputs of one (layer, tokens, rank) cell, as the benchmark draws them."""

    hidden: torch.Tensor
    routing: Routing
    lora: LoRAContext | None

    @staticmethod
    def make(
        layer: MoELayerWeights, tokens: int, rank: int, num_slots: int, experts_hit: int = 0
    ) -> CellInputs:
        """``experts_hit``: route only to the first that many experts (compile workers with
        a few experts in memory); 0 = all."""
        device = layer.w13.device
        experts = experts_hit or layer.num_experts
        hidden = random_hidden(
            tokens, layer.hidden_size, dtype=layer.dtype, device=device, seed=tokens
        )
        routing = random_routing(tokens, experts, layer.router.top_k, device=device, seed=tokens)
        lora = None
        if rank > 0:
            slots = random_slots(layer, num_slots, rank)
            lora = LoRAContext(slots, round_robin_slots(tokens, min(tokens, MAX_ADAPTERS), device))
        return CellInputs(hidden, routing, lora)


class Timer:
    """Times configurations of one cell (CUDA graph replay; failures time as infinite)."""

    def __init__(self, layer: MoELayerWeights, inputs: CellInputs) -> None:
        self.layer = layer
        self.inputs = inputs
        self.times: dict[MoEConfig, float] = {}

    def _as_run(self, config: MoEConfig) -> MoEConfig:
        """``config`` as a forward of the layer runs it (``kernels.forward.as_run``)."""
        rank = 0 if self.inputs.lora is None else self.inputs.lora.slots.max_rank
        return as_run(config, self.layer, rank)

    def run(self, config: MoEConfig) -> torch.Tensor:
        i = self.inputs
        return fused_moe(i.hidden, self.layer, i.lora, i.routing, self._as_run(config))

    def __call__(self, config: MoEConfig) -> float:
        """The first timing of ``config`` (kept: the search compares against it)."""
        if config not in self.times:
            self.times[config] = self.measure(config)
        return self.times[config]

    def measure(self, config: MoEConfig) -> float:
        """A fresh timing of ``config`` (µs; infinite where it cannot run)."""
        try:
            return self._graph_time_us(config)
        except Exception:  # resources exceeded, compile failures: never chosen
            return math.inf

    def _graph_time_us(self, config: MoEConfig) -> float:
        self.run(config)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(config)
        ms = triton.testing.do_bench(graph.replay, warmup=3, rep=25, return_mode="median")
        return float(ms) * 1e3

    def error(self, config: MoEConfig) -> float:
        """Against the float32 reference of the numerics ``config`` runs with (FP8
        activations or not)."""
        i = self.inputs
        run = self._as_run(config)
        expected = moe_forward_reference(
            i.hidden, self.layer, i.lora, i.routing, fp8_activations=run.w13.fp8_activations
        )
        return relative_error(fused_moe(i.hidden, self.layer, i.lora, i.routing, run), expected)


@dataclass(frozen=True)
class AutotuneResult:
    shape: LayerShape
    rank: int
    configs: dict[int, MoEConfig]  # bucket → configuration
    seconds: float
    timed: int  # configurations timed
    complete: bool  # every bucket searched to the end within the budget


def autotune(
    layer: MoELayerWeights,
    rank: int,
    *,
    budget_s: float,
    buckets: Sequence[int] = BUCKETS,
    num_slots: int = 8,
    jobs: int = 1,
    log: Callable[[str], None] = print,
) -> AutotuneResult:
    """Tune ``layer``'s shape with LoRA rank ``rank`` (0: base) on its GPU, within
    ``budget_s`` seconds (compilation included)."""
    began = time.monotonic()
    shape = layer_shape(layer)
    elem_size = layer.dtype.itemsize
    starts = {
        m: heuristic_config(
            m, shape.experts, shape.hidden, shape.inter, shape.top_k, elem_size, fp8=layer.fp8
        )
        for m in buckets
    }
    if jobs > 1:
        from kernels.compile_pool import CompileJob, compile_all

        tasks = [
            CompileJob.of(layer, m, rank, num_slots, config)
            for m in buckets
            for config in precompile_set(
                starts[m], m * shape.top_k / shape.experts, rank, fp8=layer.fp8
            )
        ]
        failures = compile_all(tasks, jobs, deadline=began + budget_s / 2)
        log(
            f"autotune {shape.key} r={rank}: compiled {len(tasks)} candidates in "
            f"{time.monotonic() - began:.0f} s with {jobs} processes ({failures} failed)"
        )
    best: dict[int, MoEConfig] = {}
    timed = 0
    complete = True
    previous: MoEConfig | None = None
    for index, tokens in enumerate(buckets):
        left = began + budget_s - time.monotonic()
        deadline = time.monotonic() + left / (len(buckets) - index)
        timer = Timer(layer, CellInputs.make(layer, tokens, rank, num_slots))
        start = starts[tokens]
        if previous is not None and timer(previous) < timer(start):
            start = previous
        rows_per_expert = tokens * shape.top_k / shape.experts
        found = search(
            timer, start, rows_per_expert, rank, deadline, elem_size,
            fp8=layer.fp8, hopper=hopper_searched(layer),
        )  # fmt: skip
        complete = complete and time.monotonic() <= deadline
        if time.monotonic() <= deadline:  # the budget first: a cut-short bucket keeps its best
            found = confirmed(start, [found], timer.measure)
        error = timer.error(found)
        if not error < TOLERANCE:  # never keep a wrong configuration
            log(f"autotune M={tokens}: best config off by {error:.1e}, heuristic kept")
            found = starts[tokens]
        timed += len(timer.times)
        best[tokens] = previous = found
        log(
            f"autotune {shape.key} r={rank} M={tokens}: {timer(found):.1f} µs "
            f"(heuristic {timer(starts[tokens]):.1f}; {len(timer.times)} timed)"
        )
        del timer
    seconds = time.monotonic() - began
    return AutotuneResult(shape, rank, best, seconds, timed, complete)


def refine(
    layer: MoELayerWeights,
    rank: int,
    configs: dict[int, MoEConfig],
    *,
    num_slots: int = 8,
    knobs: str = "program",
    log: Callable[[str], None] = print,
) -> dict[int, MoEConfig]:
    """``configs`` (bucket → configuration, e.g. a shipped table's rows) with ``knobs``
    searched around each: "program", the program layout knobs (``program_knobs``), or
    "hopper", the Hopper kernels (``hopper_knobs``; where ``hopper_searched``); the rest of
    the configuration is kept. A variant is kept only if faster and within ``TOLERANCE`` of
    the reference. Each round times all its variants once; the two fastest of those faster
    than the row meet the row again in alternating re-timings (``confirmed``)."""
    elem_size = layer.dtype.itemsize

    def fit(config: MoEConfig) -> MoEConfig:
        return fit_stages(config, elem_size, rank, fp8=layer.fp8)

    rounds: list[Callable[[MoEConfig], list[MoEConfig]]] = (
        [functools.partial(program_knobs, knob=knob) for knob in PROGRAM_KNOBS]
        if knobs == "program"
        else [hopper_knobs] if hopper_searched(layer) else []
    )  # fmt: skip
    refined = {}
    for tokens, start in sorted(configs.items()):
        timer = Timer(layer, CellInputs.make(layer, tokens, rank, num_slots))
        best = fit(start)
        for candidates in rounds:
            faster = sorted(
                (c for c in map(fit, candidates(best)) if timer(c) < timer(best)), key=timer
            )
            correct = [c for c in faster if timer.error(c) < TOLERANCE]
            best = confirmed(best, correct[:2], timer.measure)
        refined[tokens] = best
        log(
            f"refine {layer_shape(layer).key} r={rank} M={tokens}: {timer(best):.1f} µs "
            f"(was {timer(fit(start)):.1f})"
        )
        del timer
    return refined
