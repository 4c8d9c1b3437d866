"""What a start-up autotune budget buys over the heuristic: ``python -m kernels.tune_budget``.

For each shape and each budget in ``--budgets`` the executor's start-up search
(``kernels.autotune``, ``--jobs`` compile workers, every token bucket) runs in a process of its
own with an empty Triton cache, as on a fresh pod; then the configurations it chose and the
heuristic's are timed again side by side (base + LoRA at ``--rank``, the benchmark's CUDA
graph timing) at ``--tokens``, each checked against the float32 reference. Re-timing matters:
the search's own time of its best is the minimum of many noisy timings, biased low.

The table gives the heuristic's µs and, per budget, heuristic time / tuned time (above 1: the
search found something faster) with their geometric mean. ``--shapes`` takes the benchmark's
shapes and zoo and two shapes nobody tuned for (``HELD_OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from kernels.autotune import BUCKETS, TOLERANCE, CellInputs, Timer, autotune
from kernels.bench import SHAPES, SLOTS, TOKENS, ZOO
from kernels.config_select import ConfigSelector
from kernels.configs import device_name
from kernels.forward import layer_shape
from kernels.model_shape import LayerShape
from kernels.synthetic import fp8_layer, random_layer

#: Deployed shapes neither the tables nor the heuristic's rules were fitted on.
HELD_OUT = {
    "olmoe": LayerShape(64, 2048, 1024, 8, "OLMoE-1B-7B"),
    "deepseek_v2_lite": LayerShape(64, 2048, 1408, 6, "DeepSeek-V2-Lite routed"),
}
ALL_SHAPES = SHAPES | ZOO | HELD_OUT


@dataclass(frozen=True)
class BudgetRun:
    """One search at one budget, and its configurations timed against the heuristic's."""

    shape: str
    fp8: bool
    budget_s: float
    seconds: float  # the search's wall time, compilation included
    complete: bool
    timed: int
    heuristic_us: dict[int, float]  # tokens → µs
    tuned_us: dict[int, float]
    configs: dict[int, dict[str, object]]  # tokens → the tuned configuration (to_json)

    def speedups(self) -> dict[int, float]:
        return {m: self.heuristic_us[m] / self.tuned_us[m] for m in self.heuristic_us}

    def geomean(self) -> float:
        values = list(self.speedups().values())
        return math.exp(sum(math.log(v) for v in values) / len(values))


def run_here(
    key: str, fp8: bool, budget_s: float, rank: int, tokens: list[int], jobs: int
) -> BudgetRun:
    """The search and the timing in this process (its Triton cache as it is)."""
    shape = ALL_SHAPES[key]
    device = torch.device("cuda")
    layer = random_layer(shape.experts, shape.hidden, shape.inter, shape.top_k, device=device)
    if fp8:
        layer = fp8_layer(layer)
    result = autotune(
        layer, rank, budget_s=budget_s, num_slots=SLOTS, jobs=jobs, log=lambda _line: None
    )
    # Both as the executor's selector hands them out (stages fitted to the rank).
    heuristic = ConfigSelector(device_name(device), use_tables=False)
    tuned = ConfigSelector(device_name(device), use_tables=False)
    keyed = layer_shape(layer)
    tuned.add(keyed, rank, result.configs)
    heuristic_us, tuned_us, chosen = {}, {}, {}
    for m in tokens:
        timer = Timer(layer, CellInputs.make(layer, m, rank, SLOTS))
        configs = [s.select(m, keyed, rank, layer.dtype).config for s in (heuristic, tuned)]
        for config in configs:
            error = timer.error(config)
            if not error < TOLERANCE:
                raise AssertionError(f"{key} M={m}: {config} off the reference by {error:.1e}")
        heuristic_us[m], tuned_us[m] = timer(configs[0]), timer(configs[1])
        chosen[m] = configs[1].to_json()
    return BudgetRun(
        key, fp8, budget_s, result.seconds, result.complete, result.timed, heuristic_us, tuned_us,
        chosen,
    )  # fmt: skip


def run_fresh(
    key: str, fp8: bool, budget_s: float, rank: int, tokens: list[int], jobs: int
) -> BudgetRun:
    """``run_here`` in a new process with an empty Triton cache (a pod's first start)."""
    with tempfile.TemporaryDirectory(prefix="tune-budget-") as cache:
        argv = [
            sys.executable, "-m", "kernels.tune_budget", "--in-process", "--shapes", key,
            "--budgets", str(budget_s), "--rank", str(rank), "--jobs", str(jobs),
            "--tokens", ",".join(map(str, tokens)), "--json-lines",
        ]  # fmt: skip
        if fp8:
            argv.append("--fp8")
        env = os.environ | {"TRITON_CACHE_DIR": cache}
        done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    line = done.stdout.strip().splitlines()[-1]
    return _from_json(json.loads(line))


def _from_json(data: dict[str, object]) -> BudgetRun:
    def by_tokens(value: object) -> dict[int, float]:
        assert isinstance(value, dict)
        return {int(m): float(us) for m, us in value.items()}

    fields = dict(data)
    fields["heuristic_us"] = by_tokens(data["heuristic_us"])
    fields["tuned_us"] = by_tokens(data["tuned_us"])
    configs = data["configs"]
    assert isinstance(configs, dict)
    fields["configs"] = {int(m): c for m, c in configs.items()}
    return BudgetRun(**fields)  # type: ignore[arg-type]


def markdown(runs: list[BudgetRun], tokens: list[int]) -> str:
    cells = " | ".join(f"M = {m}" for m in tokens)
    lines = [
        f"| shape | weights | budget s | search s | complete | timed | {cells} | geomean |",
        "|---|---|---:|---:|---|---:|" + "---:|" * len(tokens) + "---:|",
    ]
    seen: set[tuple[str, bool]] = set()
    for run in runs:
        name = ALL_SHAPES[run.shape].label
        weights = "fp8" if run.fp8 else "bf16"
        if (run.shape, run.fp8) not in seen:  # the heuristic's own µs once per shape
            seen.add((run.shape, run.fp8))
            us = " | ".join(f"{run.heuristic_us[m]:.1f} µs" for m in tokens)
            lines.append(f"| {name} | {weights} | heuristic | - | - | - | {us} | 1.00 |")
        ratios = " | ".join(f"{run.speedups()[m]:.2f}" for m in tokens)
        lines.append(
            f"| {name} | {weights} | {run.budget_s:g} | {run.seconds:.0f} | "
            f"{'yes' if run.complete else 'no'} | {run.timed} | {ratios} | {run.geomean():.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start-up autotune gain per budget (GPU)")
    parser.add_argument("--shapes", default="olmoe,deepseek_v2_lite",
                        help="comma list of " + ",".join(ALL_SHAPES))  # fmt: skip
    parser.add_argument("--budgets", default="15,45,150", help="seconds, comma list")
    parser.add_argument("--fp8", action="store_true", help="the shapes with FP8 experts")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="compile workers (the executor's: up to 8)")  # fmt: skip
    parser.add_argument("--in-process", action="store_true",
                        help="no fresh process and Triton cache per search")  # fmt: skip
    parser.add_argument("--json-lines", action="store_true", help="one JSON line per run")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if not set(tokens) <= set(BUCKETS):
        parser.error(f"--tokens: token buckets only ({','.join(map(str, BUCKETS))})")
    run = run_here if args.in_process else run_fresh
    runs = []
    for key in args.shapes.split(","):
        for budget in (float(b) for b in args.budgets.split(",")):
            result = run(key, args.fp8, budget, args.rank, tokens, args.jobs)
            runs.append(result)
            if args.json_lines:
                print(json.dumps(dataclasses.asdict(result)), flush=True)
            else:
                print(f"{key} {budget:g} s: geomean {result.geomean():.2f}", flush=True)
    if not args.json_lines:
        gpu = torch.cuda.get_device_name()
        print(f"\nStart-up autotune against the heuristic on {gpu}, rank {args.rank}:\n")
        print(markdown(runs, tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
