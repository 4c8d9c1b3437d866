"""The stress run (``bench_forward --stress``): many client processes, random T across the
graph buckets, mixed adapters with slot churn, unary and streams, every answer checked against
the same request computed alone and eagerly. Short on the CPU (batching races need no GPU);
a minute with 32 clients on a GPU, CUDA graphs on."""

from __future__ import annotations

import pytest
import torch

from executor_service.bench.stress import StressSettings, run


def test_stress_on_the_cpu() -> None:
    settings = StressSettings(seconds=12, device="cpu", shape="tiny", clients=6, pool=24)
    report = run(settings)
    print(report.table())
    assert not report.failures(), report.table()
    assert report.codes["OK"] >= 50, report.table()
    assert report.mean_batch > 1.0, "no requests were merged"
    assert report.slot_loads > settings.slots, "the slots did not churn"
    assert report.slot_evictions > 0
    # The latency table accounts for every answer, once by mode and once by size.
    assert sorted(report.latency_by_mode) == sorted(report.by_mode)
    for split in (report.latency_by_mode, report.latency_by_size):
        assert sum(map(len, split.values())) == report.requests
    assert "| unary clients |" in report.table() and "| T " in report.table()
    # The slowest answers named, slowest first, each within the run.
    slowest = report.slowest
    assert len(slowest) == 5 and slowest == sorted(slowest, key=lambda c: -c.seconds)
    assert slowest[0].seconds == max(max(t) for t in report.latency_by_mode.values())
    for call in slowest:
        assert call.mode in report.by_mode and call.tokens >= 1
        assert -1.0 < call.began_s < settings.seconds + 60, call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stress_on_the_gpu() -> None:
    settings = StressSettings(seconds=60, device="cuda", clients=32)
    report = run(settings)
    print(report.table())
    assert not report.failures(), report.table()
    assert report.mean_batch > 1.0, "no requests were merged"
    assert report.slot_loads > settings.slots, "the slots did not churn"
    assert len(report.graph_replays) >= 6, f"few graph buckets hit: {report.graph_replays}"
    assert report.eager_launches == 0, "a launch up to the largest bucket ran eagerly"
