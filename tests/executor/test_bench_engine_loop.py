"""The launch-loop benchmark runs end to end on the CPU (no speed asserted): fake front ends in
their own processes keep requests in flight through the engine's wire, and every answer is
checked against twice its input."""

from __future__ import annotations

import pytest

from executor_service.bench import engine_loop


def test_the_engine_loop_bench_answers_every_request_right(
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine_loop.main(["--front-ends=2", "--threads=3", "--tokens=5", "--seconds=1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 2, rows  # requests alone, then combined while they wait
    for row, combine_after in zip(rows, ["0", "2"], strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[:4] == ["2", "3", "5", combine_after]
        assert float(cells[4].replace(",", "")) > 0  # requests per second
        assert float(cells[5]) > 0 and float(cells[6]) > 0  # the loop's time and CPU on them
        assert cells[8:] == ["0", "0"]  # no errors, no wrong answers


def test_a_wrong_answer_fails_the_engine_loop_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_loop, "doubled", lambda hidden, *_: hidden * 3)
    report = engine_loop.run(engine_loop.LoopSettings(front_ends=1, threads=2, seconds=0.5))
    assert report.requests > 0 and report.mismatches == report.requests
