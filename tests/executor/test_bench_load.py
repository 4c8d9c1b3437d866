"""The load benchmark runs end to end on the CPU in --small mode (no speed asserted): the
registry on both backends as its own process, every stage timed, Forward from a client process
idle and during loads."""

from __future__ import annotations

import re

import pytest

from executor_service.bench import load as bench_load


def test_small_cpu_bench_times_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    bench_load.main(
        ["--small", "--device=cpu", "--forwards=1", "--idle-seconds=0.5", "--warm-loads=2"]
    )
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| ([A-Za-z0-9 ()]+) \| (\d+\.\d+) \|", out, re.MULTILINE))
    steps = ["upload", "cold", "disk warm", "host warm", "download", "pack", "cold (S3)"]
    assert sorted(rows) == sorted(steps), out
    assert all(float(seconds) > 0 for seconds in rows.values()), out
    forward = dict(
        re.findall(r"^\| (alone|a cold load|a disk warm load) \| (\d+) \|", out, re.MULTILINE)
    )
    assert sorted(forward) == ["a cold load", "a disk warm load", "alone"], out
    assert all(int(calls) > 0 for calls in forward.values()), out
    assert re.search(
        r"^\| a disk warm load \| \d+ \| [\d.]+ \| [+-]\d+% \| [\d.]+ \| 2 \| [\d.]+ "
        r"\| -?[\d.]+ \|$",
        out,
        re.M,
    )
