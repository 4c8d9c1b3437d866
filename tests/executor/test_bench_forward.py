"""The Forward benchmark runs end to end on the CPU with the tiny shape (no speed asserted):
executor, echo server and clients as their own processes, every row and column filled, and
every row's sampled answers checked against the same requests computed alone."""

from __future__ import annotations

import re

import pytest

from executor_service.bench import forward as bench_forward
from executor_service.bench.answers import CPU_ROW_TOLERANCE


@pytest.mark.parametrize(
    ("transport", "modes"),
    [("grpc", "unary,stream"), ("shm", "unary"), ("channel", "unary")],
    ids=["grpc", "shm", "channel"],
)
def test_tiny_cpu_bench_prints_every_row(
    capsys: pytest.CaptureFixture[str], transport: str, modes: str
) -> None:
    bench_forward.main(
        [
            "--shape=tiny",
            "--device=cpu",
            "--tokens=1,8",
            "--clients=2,3",
            "--iters=4",
            "--warmup=1",
            f"--transport={transport}",
            f"--modes={modes}",
            "--frontends=1",
        ]
    )
    out = capsys.readouterr().out
    assert f"Forward over {transport}" in out
    rows = [line for line in out.splitlines() if re.match(r"^\| (unary|stream) \| \d", line)]
    count = 4 * len(modes.split(","))
    table, stages, cpu = rows[:count], rows[count : 2 * count], rows[2 * count :]
    assert len(table) == count and len(stages) == count and len(cpu) == count, out
    for line in stages:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[-1]) > 0, line  # the whole launch on the loop
    for line in cpu:
        cells = [c.strip() for c in line.strip("|").split("|")]
        executor, clients_cpu, busy = (float(c) for c in cells[3:6])
        assert executor > 0 and clients_cpu > 0 and busy > 0, line
        assert (cells[6] == "—") == (transport == "channel"), line  # an echo's own CPU
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        clients, front_ends = cells[2], cells[3]
        p50, p99, server = (float(c) for c in cells[4:7])
        assert front_ends == "1"
        assert 0 < p50 <= p99 and server > 0, line
        if transport == "channel":  # no gRPC echo applies
            assert cells[8] == "—", line
        else:
            assert float(cells[8]) > 0  # the transport floor
        assert float(cells[10].replace(",", "")) > 0  # tokens/s
        assert float(cells[11]) > 0  # mean batch
        checks = re.fullmatch(r"(\d+) \((\S+)\)", cells[12])  # answers checked (worst error)
        assert checks is not None, line
        assert int(checks[1]) > 0 and float(checks[2]) <= CPU_ROW_TOLERANCE, line
        assert (cells[7] == "—") == (clients != "1"), line  # kernel time for one client
    assert "(churn)" in table[3]
