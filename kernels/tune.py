"""Tune the launch configurations on this GPU: ``python -m kernels.tune``.

For each benchmark shape and token count it times ``fused_moe`` with LoRA (the benchmark's
inputs and method: CUDA graph replay under do_bench) over a small search, one knob group at a
time starting from the heuristic: BLOCK_M, then the w13 tiles, then the w2 tiles, then the
sum over k and the LoRA segments per pass. The best configuration is checked against the
float32 reference and stored for rank 0 (base) and the LoRA rank in
``kernels/configs/<GPU name>.json`` (or ``--out``), after every cell, so a run cut short keeps
what it found.

``--around-table`` searches instead around the stored configuration of each cell: where the
LoRA shrink runs (``fused_shrink`` of w13 and w2, with the tiles per program it wants) and the
segments per pass; at large M then the launch order (``group_m``) and the tiles in that order. With
``--jobs N`` every candidate is first compiled by N worker processes (Triton's cache is on
disk), so the timing loop, one process on the GPU, waits for no compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import triton.testing

from kernels.align import max_padded_rows
from kernels.bench import BF16_TOLERANCE, MAX_ADAPTERS, SHAPES, SLOTS, TOKENS, Shape
from kernels.configs import (
    GemmConfig,
    MoEConfig,
    config_path,
    device_name,
    fit_stages,
    heuristic_config,
    shape_key,
)
from kernels.forward import fused_moe
from kernels.reference import moe_forward_reference
from kernels.synthetic import (
    random_hidden,
    random_layer,
    random_routing,
    random_slots,
    relative_error,
    round_robin_slots,
)
from kernels.types import LoRAContext, MoELayerWeights

# (block_n, block_k, tiles_per_program, num_warps, num_stages); w13's block_n is per half.
W13_STREAMING = [
    (32, 128, 1, 4, 4), (16, 128, 1, 4, 4), (64, 128, 1, 4, 4), (16, 256, 1, 4, 3),
    (32, 256, 1, 4, 3), (32, 64, 1, 4, 6),
]  # fmt: skip
W13_COMPUTE = [
    (128, 64, 4, 8, 3), (128, 64, 2, 8, 3), (128, 64, 1, 8, 3), (64, 64, 4, 8, 3),
    (64, 128, 4, 8, 3), (64, 64, 1, 4, 4),
]  # fmt: skip
W2_STREAMING = [
    (64, 128, 1, 4, 4), (32, 128, 1, 4, 4), (128, 128, 1, 4, 3), (32, 256, 1, 4, 3),
    (64, 64, 1, 4, 6),
]  # fmt: skip
W2_COMPUTE = [
    (256, 64, 4, 8, 3), (256, 64, 1, 8, 3), (128, 64, 4, 8, 4), (128, 128, 4, 8, 3),
    (256, 64, 16, 8, 3), (128, 64, 1, 4, 4),
]  # fmt: skip


def block_m_options(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 4:
        return [16]
    if rows_per_expert <= 16:
        return [16, 32]
    if rows_per_expert <= 64:
        return [16, 32, 64]
    return [64, 128]


class Tuner:
    """Times configurations of one (shape, tokens, rank) cell."""

    def __init__(self, shape: Shape, layer: MoELayerWeights, tokens: int, rank: int) -> None:
        device = layer.w13.device
        self.layer = layer
        self.hidden = random_hidden(tokens, shape.hidden, device=device, seed=tokens)
        self.routing = random_routing(
            tokens, shape.experts, shape.top_k, device=device, seed=tokens
        )
        token_slots = round_robin_slots(tokens, min(tokens, MAX_ADAPTERS), device)
        self.lora = LoRAContext(random_slots(layer, SLOTS, rank), token_slots)
        self.times: dict[MoEConfig, float] = {}

    def time_us(self, config: MoEConfig) -> float:
        if config not in self.times:
            try:
                self.times[config] = self._graph_time_us(config)
            except Exception as error:  # resources exceeded, compile failures: skip the config
                print(f"  skip {config}: {type(error).__name__}: {error}"[:300], flush=True)
                self.times[config] = math.inf
        return self.times[config]

    def _graph_time_us(self, config: MoEConfig) -> float:
        def run() -> torch.Tensor:
            return fused_moe(self.hidden, self.layer, self.lora, self.routing, config)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ms = triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
        return float(ms) * 1e3

    def best_of(self, configs: list[MoEConfig]) -> MoEConfig:
        return min(configs, key=self.time_us)

    def error(self, config: MoEConfig) -> float:
        got = fused_moe(self.hidden, self.layer, self.lora, self.routing, config)
        expected = moe_forward_reference(self.hidden, self.layer, self.lora, self.routing)
        return relative_error(got, expected)


def tune_cell(tuner: Tuner, shape: Shape, tokens: int) -> MoEConfig:
    rows_per_expert = tokens * shape.top_k / shape.experts
    start = heuristic_config(tokens, shape.experts, shape.hidden, shape.inter, shape.top_k)
    best = tuner.best_of(
        [dataclasses.replace(start, block_m=bm) for bm in block_m_options(rows_per_expert)]
    )
    streaming = best.block_m <= 32
    w13_space = W13_STREAMING if streaming else W13_COMPUTE
    w2_space = W2_STREAMING if streaming else W2_COMPUTE
    best = tuner.best_of(
        [best] + [dataclasses.replace(best, w13=GemmConfig(*c)) for c in w13_space]
    )
    best = tuner.best_of([best] + [dataclasses.replace(best, w2=GemmConfig(*c)) for c in w2_space])
    segments = [1, 2, 4, 8]
    best = tuner.best_of(
        [best]
        + [dataclasses.replace(best, lora_segments=s) for s in segments]
        + [dataclasses.replace(best, atomic_sum=not best.atomic_sum)]
    )
    return best


def fused_tiles(num_tiles: int, num_blocks: int, num_sms: int) -> int:
    """Tiles per program for a fused shrink, which every program of a block repeats: as many
    as still leave about two waves of programs."""
    programs_per_block = max(1, -(-2 * num_sms // max(num_blocks, 1)))
    return max(1, -(-num_tiles // programs_per_block))


def around_candidates(
    start: MoEConfig, shape: Shape, tokens: int, rank: int, num_sms: int
) -> list[MoEConfig]:
    """Stage 1 of ``--around-table``: the LoRA segments per pass, times the shrink fused into
    w13 / w2 or not (with the tiles per program it wants) where the separate shrink launch
    has few programs: small M, or fewer than half a wave of blocks."""
    pairs = tokens * shape.top_k
    blocks = max_padded_rows(pairs, shape.experts, start.block_m) // start.block_m
    streaming = start.block_m <= 32
    try_fused = streaming or 2 * blocks <= num_sms

    def placements(gemm: GemmConfig, num_tiles: int) -> list[GemmConfig]:
        options = [dataclasses.replace(gemm, fused_shrink=False)]
        if try_fused:
            options.append(dataclasses.replace(gemm, fused_shrink=True))
        if try_fused and not streaming:
            tiles = fused_tiles(num_tiles, blocks, num_sms)
            options.append(dataclasses.replace(gemm, fused_shrink=True, tiles_per_program=tiles))
        return options

    w13_tiles = -(-shape.inter // start.w13.block_n)
    w2_tiles = -(-shape.hidden // start.w2.block_n)
    segments = [1] if tokens == 1 else [1, 2, 4]
    candidates = [
        fit_stages(dataclasses.replace(start, w13=w13, w2=w2, lora_segments=seg), 2, rank)
        for w13, w2, seg in itertools.product(
            placements(start.w13, w13_tiles), placements(start.w2, w2_tiles), segments
        )
    ]
    return list(dict.fromkeys(candidates))


def order_candidates(best: MoEConfig) -> list[MoEConfig]:
    """Stage 2 of ``--around-table`` (large M): the launch order of both GEMMs."""
    return [
        dataclasses.replace(
            best,
            w13=dataclasses.replace(best.w13, group_m=g),
            w2=dataclasses.replace(best.w2, group_m=g),
        )
        for g in (0, 1, 8)
    ]


def tile_candidates(best: MoEConfig, rank: int) -> list[MoEConfig]:
    """Stage 3 of ``--around-table`` (large M): the w13 tiles, then the w2 tiles, of the
    compute-bound search space in the chosen launch order."""
    w13 = [GemmConfig(*c, group_m=best.w13.group_m) for c in W13_COMPUTE]
    w2 = [GemmConfig(*c, group_m=best.w2.group_m) for c in W2_COMPUTE]
    return [fit_stages(dataclasses.replace(best, w13=g), 2, rank) for g in w13] + [
        fit_stages(dataclasses.replace(best, w2=g), 2, rank) for g in w2
    ]


# One compile worker's inputs, kept between tasks (tasks come sorted by shape): the layer of
# the current shape and the cells' inputs.
_WORKER_LAYER: dict[str, MoELayerWeights] = {}
_WORKER_CELLS: dict[tuple[str, int, int], Tuner] = {}


def _compile_task(task: tuple[str, int, int, str]) -> str:
    """Run one candidate (and the base model with its tiles) once, so Triton compiles it."""
    key, tokens, rank, config_json = task
    try:
        if key not in _WORKER_LAYER:
            _WORKER_LAYER.clear()
            _WORKER_CELLS.clear()
            torch.cuda.empty_cache()
            shape = SHAPES[key]
            _WORKER_LAYER[key] = random_layer(
                shape.experts, shape.hidden, shape.inter, shape.top_k, device="cuda"
            )
        if (key, tokens, rank) not in _WORKER_CELLS:
            _WORKER_CELLS[(key, tokens, rank)] = Tuner(
                SHAPES[key], _WORKER_LAYER[key], tokens, rank
            )
        tuner = _WORKER_CELLS[(key, tokens, rank)]
        config = MoEConfig.from_json(json.loads(config_json))
        fused_moe(tuner.hidden, tuner.layer, tuner.lora, tuner.routing, config)
        fused_moe(tuner.hidden, tuner.layer, None, tuner.routing, config)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # reported; the timing loop skips the config
        return f"{key} M={tokens} r={rank}: {type(error).__name__}: {error}"[:300]


def precompile(tasks: Iterable[tuple[str, int, MoEConfig, int]], jobs: int) -> None:
    """Compile the (shape key, tokens, config, rank) candidates in ``jobs`` processes."""
    work = sorted(
        {(key, tokens, rank, json.dumps(cfg.to_json())) for key, tokens, cfg, rank in tasks}
    )
    began = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for message in pool.imap_unordered(_compile_task, work):
            if message:
                print(f"  compile failed: {message}", flush=True)
    print(f"compiled {len(work)} candidates in {time.monotonic() - began:.0f} s", flush=True)


Cell = tuple[str, int, int]  # shape key, tokens, rank


def store(table: dict[str, Any], out: Path, cell: Cell, best: MoEConfig) -> None:
    """Record ``best`` for the cell (rank 16's also for the base model) and write the table."""
    key, tokens, rank = cell
    shape = SHAPES[key]
    targets = [rank] if rank != 16 else [16, 0]  # the base model shares rank 16's config
    for r in targets:
        entry = table.setdefault(
            shape_key(shape.experts, shape.hidden, shape.inter, shape.top_k, r), {}
        )
        entry[str(tokens)] = best.to_json()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def report(tuner: Tuner, cell: Cell, best: MoEConfig, note: str = "") -> None:
    err = tuner.error(best)
    if not err < BF16_TOLERANCE:
        raise SystemExit(f"{cell}: best config wrong, error {err:.2e}")
    print(
        f"{cell[0]} M={cell[1]} r={cell[2]}: {tuner.time_us(best):.1f} µs {note}"
        f"({len(tuner.times)} configs, err {err:.1e}) {best}",
        flush=True,
    )


def around_table(
    cells: list[Cell],
    table: dict[str, Any],
    out: Path,
    jobs: int,
    deadline: float,
    compile_only: bool = False,
    stages: tuple[int, ...] = (1, 2, 3),
) -> None:
    """``--around-table``: stage 1 (shrink placement × segments) for every cell, then for the
    cells at large M stage 2 (launch order) and stage 3 (tiles in that order); each stage
    compiled up front by ``jobs`` processes. ``compile_only``: compile the first stage and stop
    (to overlap it with other work). ``stages``: which of them to run."""
    began = time.monotonic()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    best: dict[Cell, MoEConfig] = {}
    for cell in cells:
        key, tokens, rank = cell
        shape = SHAPES[key]
        entry = table.get(shape_key(shape.experts, shape.hidden, shape.inter, shape.top_k, rank))
        if entry and str(tokens) in entry:
            best[cell] = MoEConfig.from_json(entry[str(tokens)])
        else:
            print(f"{cell}: no stored configuration, skipped", flush=True)

    def stage_1(cell: Cell, config: MoEConfig) -> list[MoEConfig]:
        key, tokens, rank = cell
        return around_candidates(config, SHAPES[key], tokens, rank, num_sms)

    def stage_2(cell: Cell, config: MoEConfig) -> list[MoEConfig]:
        return order_candidates(config) if config.block_m >= 64 else []

    def stage_3(cell: Cell, config: MoEConfig) -> list[MoEConfig]:
        return tile_candidates(config, cell[2]) if config.block_m >= 64 else []

    layers: dict[str, MoELayerWeights] = {}
    tuners: dict[Cell, Tuner] = {}
    for number, make_candidates in enumerate((stage_1, stage_2, stage_3), start=1):
        if number not in stages:
            continue
        stage = {cell: [config, *make_candidates(cell, config)] for cell, config in best.items()}
        stage = {cell: candidates for cell, candidates in stage.items() if len(candidates) > 1}
        if jobs > 1:
            precompile(((c[0], c[1], cfg, c[2]) for c, cfgs in stage.items() for cfg in cfgs), jobs)
        if compile_only:
            return
        for cell, candidates in stage.items():
            if time.monotonic() - began > deadline:
                print("deadline reached, stopping", flush=True)
                return
            key, tokens, rank = cell
            if key not in layers:
                shape = SHAPES[key]
                layers[key] = random_layer(
                    shape.experts, shape.hidden, shape.inter, shape.top_k, device="cuda"
                )
            if cell not in tuners:
                tuners[cell] = Tuner(SHAPES[key], layers[key], tokens, rank)
            tuner = tuners[cell]
            best[cell] = tuner.best_of(candidates)
            for config in candidates:
                print(f"  {cell} {tuner.time_us(config):8.1f} µs {config}", flush=True)
            report(tuner, cell, best[cell], f"(was {tuner.time_us(candidates[0]):.1f}) ")
            store(table, out, cell, best[cell])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tune kernels' launch configs on this GPU")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--ranks", default="16", help="LoRA ranks to tune (comma list)")
    parser.add_argument("--extra", default="qwen3:64:64", help="extra shape:tokens:rank cells")
    parser.add_argument("--out", help="JSON to update (default: kernels/configs/<GPU>.json)")
    parser.add_argument("--deadline-s", type=float, default=math.inf, help="stop after this")
    parser.add_argument(
        "--around-table", action="store_true", help="search around the stored configurations"
    )
    parser.add_argument("--jobs", type=int, default=1, help="compile processes (--around-table)")
    parser.add_argument(
        "--compile-only", action="store_true", help="--around-table: only compile a stage"
    )
    parser.add_argument("--stages", default="1,2,3", help="--around-table: stages to run")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    out = Path(args.out) if args.out else config_path(device_name(device))
    table = json.loads(out.read_text()) if out.exists() else {}
    began = time.monotonic()
    cells = [
        (key, int(t), int(r))
        for key in args.shapes.split(",")
        for r in args.ranks.split(",")
        for t in args.tokens.split(",")
    ]
    cells += [(k, int(t), int(r)) for k, t, r in (c.split(":") for c in args.extra.split(",") if c)]
    if args.around_table:
        stages = tuple(int(n) for n in args.stages.split(","))
        around_table(cells, table, out, args.jobs, args.deadline_s, args.compile_only, stages)
        return 0
    layers: dict[str, MoELayerWeights] = {}
    for cell in cells:
        if time.monotonic() - began > args.deadline_s:
            print("deadline reached, stopping", flush=True)
            break
        key, tokens, rank = cell
        shape = SHAPES[key]
        if key not in layers:
            layers.clear()
            torch.cuda.empty_cache()
            layers[key] = random_layer(
                shape.experts, shape.hidden, shape.inter, shape.top_k, device=device
            )
        tuner = Tuner(shape, layers[key], tokens, rank)
        best = tune_cell(tuner, shape, tokens)
        report(tuner, cell, best)
        store(table, out, cell, best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
