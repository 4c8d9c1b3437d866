"""The decoding benchmark on the CPU: every variant's row is printed, and the remote blocks'
tokens equal the in-process kernels' (the executor computes the same float32 math)."""

from __future__ import annotations

import re

import pytest

from executor_service.bench import decode


def test_tiny_cpu_decode_bench_prints_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    decode.main(["--shape=tiny", "--device=cpu", "--layers=2", "--batch=1,3", "--new-tokens=3"])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^\| ([^|]+?) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+)/(\d+) \|$", line)
        if match:
            rows[(match[1], int(match[2]))] = (float(match[3]), int(match[5]), int(match[6]))
    variants = {
        "kernels, in process",
        "transformers",
        "remote, message (message)",
        "remote, network channel (network_channel)",  # Gloo on the CPU
    }
    assert {name for name, _ in rows} == variants, out
    for (name, batch), (ms, same, total) in rows.items():
        assert ms > 0 and total == batch, (name, batch)
        if name != "transformers":  # the same float32 kernels in and out of process
            assert same == batch, (name, batch, out)
