"""Fuzz tests: hypothesis with a fixed seed and few examples in ``make test``; many more with
``--long`` (``make fuzz``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

_COMMON = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# Seeded (derandomize): the short run in CI is the same run every time.
settings.register_profile("short", _COMMON, max_examples=60, derandomize=True)
settings.register_profile("long", _COMMON, max_examples=2000)


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile("long" if config.getoption("--long") else "short")
