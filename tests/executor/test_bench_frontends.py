"""The front-ends-alone benchmark runs end to end on the CPU (no speed asserted): real front-end
processes over an engine whose layer doubles its input, bench clients in their own processes,
their answers checked against twice their input, the echo floor beside."""

from __future__ import annotations

import os

import pytest

from executor_service.bench import frontends


def test_the_front_ends_bench_answers_every_request_right(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    frontends.main(["--frontends=2", "--clients=1,3", "--iters=12", "--hidden=256"])
    # The front ends' metrics folder is gone: later children must not be sent there.
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == before
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    data = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]
    assert [row[0] for row in data] == ["1", "3"]
    for row in data:
        assert float(row[1].replace(",", "")) > 0  # requests per second
        assert float(row[4]) > 0  # the front ends' CPU per call (the echo's may be < a tick)
        assert float(row[7]) > 0  # the echo floor ran beside
        checked = int(row[10].split()[0])
        assert checked >= int(row[0]) * 5  # every warm-up answer at least, none wrong


def test_a_wrong_answer_fails_the_front_ends_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frontends, "doubled", lambda hidden, *_: hidden * 3)
    with pytest.raises(SystemExit):
        frontends.main(["--frontends=1", "--clients=1", "--iters=6", "--hidden=256"])
