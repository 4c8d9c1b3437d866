"""Tune the launch configurations on this GPU: ``python -m kernels.tune``.

For each benchmark shape and token count it times ``fused_moe`` with LoRA (the benchmark's
inputs and method: CUDA graph replay under do_bench) over a small search, one knob group at a
time starting from the heuristic: BLOCK_M, then the w13 tiles, then the w2 tiles, then the
sum over k and the LoRA segments per pass. The best configuration is checked against the
float32 reference and stored for rank 0 (base) and the LoRA rank in
``kernels/configs/<GPU name>.json`` (or ``--out``), after every cell, so a run cut short keeps
what it found.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import triton.testing

from kernels.bench import BF16_TOLERANCE, MAX_ADAPTERS, SHAPES, SLOTS, TOKENS, Shape
from kernels.configs import (
    GemmConfig,
    MoEConfig,
    config_path,
    device_name,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tune kernels' launch configs on this GPU")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--ranks", default="16", help="LoRA ranks to tune (comma list)")
    parser.add_argument("--extra", default="qwen3:64:64", help="extra shape:tokens:rank cells")
    parser.add_argument("--out", help="JSON to update (default: kernels/configs/<GPU>.json)")
    parser.add_argument("--deadline-s", type=float, default=math.inf, help="stop after this")
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
    layers: dict[str, MoELayerWeights] = {}
    for key, tokens, rank in cells:
        if time.monotonic() - began > args.deadline_s:
            print("deadline reached, stopping", flush=True)
            break
        shape = SHAPES[key]
        if key not in layers:
            layers.clear()
            torch.cuda.empty_cache()
            layers[key] = random_layer(
                shape.experts, shape.hidden, shape.inter, shape.top_k, device=device
            )
        tuner = Tuner(shape, layers[key], tokens, rank)
        best = tune_cell(tuner, shape, tokens)
        err = tuner.error(best)
        if not err < BF16_TOLERANCE:
            raise SystemExit(f"{key} M={tokens} r={rank}: best config wrong, error {err:.2e}")
        print(
            f"{key} M={tokens} r={rank}: {tuner.time_us(best):.1f} µs "
            f"({len(tuner.times)} configs, err {err:.1e}) {best}",
            flush=True,
        )
        targets = [rank] if rank != 16 else [16, 0]  # the base model shares rank 16's config
        for r in targets:
            entry = table.setdefault(
                shape_key(shape.experts, shape.hidden, shape.inter, shape.top_k, r), {}
            )
            entry[str(tokens)] = best.to_json()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
