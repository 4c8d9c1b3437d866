"""Fixtures of the chart tests: the loaded chart and its renderings."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import pytest

from tests.helm.chart import CHART_DIR, Release, ci_values, render


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def defaults(chart: helm.Chart) -> Release:
    return render(chart)


@pytest.fixture(scope="session")
def production(chart: helm.Chart) -> Release:
    """PostgreSQL, S3, auth, 3 registries, 4 executors (ci/production-values.yaml)."""
    return render(chart, ci_values("production"))


@pytest.fixture(scope="session")
def autoscaling(chart: helm.Chart) -> Release:
    """HPA, hostPath model, PodMonitors (ci/autoscaling-values.yaml)."""
    return render(chart, ci_values("autoscaling"))


@pytest.fixture(scope="session")
def cpu(chart: helm.Chart) -> Release:
    """No GPU, model from S3 into an emptyDir (ci/cpu-values.yaml)."""
    return render(chart, ci_values("cpu"))
