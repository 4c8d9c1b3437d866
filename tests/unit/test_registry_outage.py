"""The executor's view of a registry outage (``executor_service.registry_outage``), on a clock
the test moves: while the registry is down, requests never wait on it — at most one call per
``probe_seconds`` goes out to find it back — and the outage is reported once each way."""

from __future__ import annotations

import logging

import pytest

from executor_service.registry_outage import RegistryOutage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_registry_that_answers_is_always_asked() -> None:
    outage = RegistryOutage("registry:50051", clock=Clock())
    assert not outage.down and outage.since is None
    assert all(outage.may_probe() for _ in range(100))


def test_during_an_outage_one_call_per_probe_interval_looks_for_the_registry() -> None:
    clock = Clock()
    changes: list[float | None] = []
    outage = RegistryOutage("registry:50051", changes.append, probe_seconds=1.0, clock=clock)
    outage.failed("GetAdapter sql@prod: connection refused")
    assert outage.down and changes == [outage.since]
    # The failed call was the probe of this interval: the requests behind it are not sent.
    assert not any(outage.may_probe() for _ in range(1000))
    clock.now += 0.99
    assert not outage.may_probe()
    clock.now += 0.02
    assert outage.may_probe()
    assert not any(outage.may_probe() for _ in range(1000))
    outage.failed("again")  # still the same outage: no second report
    assert len(changes) == 1
    outage.answered()
    assert outage.since is None and changes[-1] is None and len(changes) == 2
    assert all(outage.may_probe() for _ in range(100))


def test_the_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="executor_service.registry_outage")
    outage = RegistryOutage("registry:50051", clock=Clock())
    for _ in range(5):
        outage.failed("connection refused")
    for _ in range(5):
        outage.answered()
    events = [record.getMessage() for record in caplog.records]
    assert events == ["registry_unreachable_serving_cached", "registry_reachable_again"]
