"""The download benchmark runs end to end in --small mode (no speed or cost asserted): a registry
process, both paths, rates and CPU costs in the table."""

from __future__ import annotations

import re

import pytest

from executor_service.bench import download as bench_download


def test_small_download_bench_measures_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    bench_download.main(["--small", "--repeat=1", "--streams=2"])
    out = capsys.readouterr().out
    rows = re.findall(
        r"^\| (urls|stream) \| (\d+\.\d+) \((\d+\.\d+)\) \| (\d+\.\d+) \| (\d+\.\d+) \|",
        out,
        re.MULTILINE,
    )
    assert [row[0] for row in rows] == ["urls", "stream"], out
