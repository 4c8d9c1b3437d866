"""The load benchmark runs end to end on the CPU in --small mode (no speed asserted): the
registry on both backends as its own process, every stage timed, Forward from a client process
idle and during loads."""

from __future__ import annotations

import re

import pytest

from executor_service import bench_load


def test_small_cpu_bench_times_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    bench_load.main(["--small", "--device=cpu", "--forwards=2"])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| ([A-Za-z0-9 ()]+) \| (\d+\.\d+) \|", out, re.MULTILINE))
    steps = ["upload", "cold", "disk warm", "host warm", "download", "pack", "cold (S3)"]
    assert sorted(rows) == sorted(steps), out
    assert all(float(seconds) > 0 for seconds in rows.values()), out
    forward = r"Forward p50 of another adapter .* ms idle .*; .* ms while a cold load runs .*"
    assert re.search(forward + r"; .* ms while a disk warm load runs", out), out
