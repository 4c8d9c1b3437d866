"""The budget study's report (``kernels.tune_budget``; its searches need a GPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kernels.tune_budget import BudgetRun, _from_json, main, markdown


def _run(budget: float, tuned_1: float) -> BudgetRun:
    return BudgetRun(
        "olmoe", False, budget, budget + 1.5, False, 40, {1: 50.0, 8: 200.0},
        {1: tuned_1, 8: 160.0}, {1: {"block_m": 16}, 8: {"block_m": 32}},
    )  # fmt: skip


def test_run_survives_its_json_line_and_reports_speedups() -> None:
    run = _run(45.0, 40.0)
    assert _from_json(json.loads(json.dumps(dataclasses.asdict(run)))) == run
    assert run.speedups() == {1: 1.25, 8: 1.25}
    assert run.geomean() == pytest.approx(1.25)


def test_table_gives_the_heuristic_once_per_shape_then_each_budget() -> None:
    lines = markdown([_run(15.0, 50.0), _run(150.0, 40.0)], [1, 8]).splitlines()
    assert len(lines) == 5
    assert lines[2] == (
        "| OLMoE-1B-7B | bf16 | heuristic | - | - | - | 50.0 µs | 200.0 µs | 1.00 |"
    )
    assert lines[3].endswith("| 15 | 16 | no | 40 | 1.00 | 1.25 | 1.12 |")
    assert lines[4].endswith("| 150 | 152 | no | 40 | 1.25 | 1.25 | 1.25 |")


def test_tokens_must_be_buckets_the_executor_runs() -> None:
    with pytest.raises(SystemExit):
        main(["--tokens", "3"])
