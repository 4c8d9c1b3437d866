"""The stress run (``bench_forward --stress``): many client processes, random T across the
graph buckets, mixed adapters with slot churn, unary and streams, every answer checked against
the same request computed alone and eagerly. Short on the CPU (batching races need no GPU);
a minute with 32 clients on a GPU, CUDA graphs on."""

from __future__ import annotations

import pytest
import torch

from executor_service.bench.stress import HostLoads, StressSettings, host_loads, run


def test_stress_on_the_cpu() -> None:
    settings = StressSettings(seconds=12, device="cpu", shape="tiny", clients=6, pool=24)
    report = run(settings)
    print(report.table())
    assert not report.failures(), report.table()
    assert report.codes["OK"] >= 50, report.table()
    assert report.mean_batch > 1.0, "no requests were merged"
    assert report.slot_loads > settings.slots, "the slots did not churn"
    assert report.slot_evictions > 0
    # Each adapter came into host memory once at most (the slots churn, the host cache keeps
    # them), the pinned ones at start-up; the report times those loads.
    loads = report.host_loads
    assert settings.pinned <= loads.count <= settings.adapters, loads
    assert loads.seconds > 0 and loads.slowest_within > 0, loads
    assert "Adapter loads into host memory" in report.table()
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


def test_clients_that_do_not_start_fail_the_run_rather_than_hang_it() -> None:
    """Clients are released together once each has started; one that has not within
    ``client_start_seconds`` fails the run (and is stopped), and the executor still stops."""
    settings = StressSettings(
        seconds=2, device="cpu", shape="tiny", clients=2, pool=4, client_start_seconds=0.0
    )
    report = run(settings)
    assert any("did not start within 0 s" in p for p in report.failures()), report.failures()
    assert not any("executor exited" in p or "did not stop" in p for p in report.problems)


def test_host_loads_from_the_load_time_histogram() -> None:
    """The host tier's loads from the executor's histogram samples: the GPU tier's ignored,
    the slowest load placed under the first bound that holds every load."""
    name = "moelora_executor_adapter_load_seconds"
    host, gpu = (("tier", "host"),), (("tier", "gpu"),)

    def bucket(le: str, tier: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return f"{name}_bucket", (("le", le), ("tier", tier))

    samples = {
        (f"{name}_count", host): 3.0, (f"{name}_sum", host): 4.5,
        bucket("0.5", "host"): 1.0, bucket("2.5", "host"): 2.0, bucket("5.0", "host"): 3.0,
        bucket("+Inf", "host"): 3.0,
        (f"{name}_count", gpu): 9.0, (f"{name}_sum", gpu): 0.1, bucket("0.001", "gpu"): 9.0,
    }  # fmt: skip
    loads = host_loads(samples)
    assert (loads.count, loads.seconds, loads.slowest_within, loads.mean) == (3, 4.5, 5.0, 1.5)
    samples[bucket("5.0", "host")] = 2.0  # the slowest beyond the last finite bound
    assert host_loads(samples).slowest_within == float("inf")
    assert host_loads({}) == HostLoads(0, 0.0, 0.0)


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
