"""Bad values are refused before anything reaches a cluster: by values.schema.json,
and by the template checks the schema cannot express."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.helm.chart import CHART_DIR, NAMESPACE, RELEASE, ci_values, render

POSTGRES: dict[str, Any] = {"type": "postgresql", "existingSecret": "db"}

# (values, what the error must name)
SCHEMA_REFUSES: dict[str, tuple[dict[str, Any], str]] = {
    "sqlite with replicas": ({"registry": {"replicas": 2}}, "/registry/replicas"),
    "replicas with local blobs": (
        {"registry": {"replicas": 2, "database": POSTGRES}},
        "/registry/blobUrl",
    ),
    "postgresql without its secret": (
        {"registry": {"database": {"type": "postgresql"}}},
        "/registry/database/existingSecret",
    ),
    "unknown database": ({"registry": {"database": {"type": "mysql"}}}, "/registry/database/type"),
    "blob url not s3": ({"registry": {"blobUrl": "http://bucket/x"}}, "/registry/blobUrl"),
    "auth without the token file": ({"auth": {"enabled": True}}, "/auth/tokensSecret"),
    "auth without the executor token": (
        {"auth": {"enabled": True, "tokensSecret": "t"}},
        "/auth/executorTokenSecret",
    ),
    "pvc source without a claim": (
        {"executor": {"model": {"pvc": {"claimName": ""}}}},
        "/executor/model/pvc/claimName",
    ),
    "hostPath source with a relative path": (
        {"executor": {"model": {"source": "hostPath", "hostPath": {"path": "models"}}}},
        "/executor/model/hostPath/path",
    ),
    "s3 source without a url": (
        {"executor": {"model": {"source": "s3"}}},
        "/executor/model/s3/url",
    ),
    "unknown model source": ({"executor": {"model": {"source": "nfs"}}}, "/executor/model/source"),
    "model name with ..": ({"executor": {"model": {"name": "a..b"}}}, "/executor/model/name"),
    "model sub-path escaping": (
        {"executor": {"model": {"subPath": "../etc"}}},
        "/executor/model/subPath",
    ),
    "cuda without a gpu": ({"executor": {"gpu": {"count": 0}}}, "/executor"),
    "one slot": ({"executor": {"numSlots": 1}}, "/executor/numSlots"),
    "rank beyond the executor's limit": ({"executor": {"maxRank": 1024}}, "/executor/maxRank"),
    "negative drain": ({"executor": {"drainSeconds": -1}}, "/executor/drainSeconds"),
    "not a quantity": ({"executor": {"shmSize": "8 GB"}}, "/executor/shmSize"),
    "negative front ends": ({"executor": {"frontends": -1}}, "/executor/frontends"),
    "empty arena": ({"executor": {"frontendArenaGiB": 0}}, "/executor/frontendArenaGiB"),
    "negative pinned arena": (
        {"executor": {"frontendArenaPinnedMiB": -1}},
        "/executor/frontendArenaPinnedMiB",
    ),
    "bad dtype": ({"executor": {"dtype": "fp8"}}, "/executor/dtype"),
    "bad digest": (
        {"images": {"executor": {"digest": "sha256:xyz"}}},
        "/images/executor/digest",
    ),
    "both monitors": (
        {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
        "/metrics",
    ),
    "typo in a key": ({"registy": {"replicas": 1}}, "registy"),
    "typo in a nested key": ({"executor": {"numSlot": 8}}, "numSlot"),
    "port out of range": ({"executor": {"port": 70000}}, "/executor/port"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_REFUSES))
def test_schema_refuses(chart: helm.Chart, case: str) -> None:
    values, where = SCHEMA_REFUSES[case]
    with pytest.raises(helm.HelmValuesError) as caught:
        render(chart, values)
    assert where in str(caught.value)


def test_schema_accepts_a_replicated_registry_on_postgresql_and_s3(chart: helm.Chart) -> None:
    values = {"registry": {"replicas": 2, "database": POSTGRES, "blobUrl": "s3://bucket/a"}}
    chart.validate_schema(chart.merge_values(values))
    chart.validate_schema(chart.merge_values(ci_values("production")))


# Checks across values the schema cannot compare; they fail the render itself.
TEMPLATE_REFUSES: dict[str, tuple[dict[str, Any], str]] = {
    "autoscaling min above max": (
        {"executor": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "minReplicas must not exceed maxReplicas",
    ),
    "liveness shorter than the drain": (
        {"executor": {"drainSeconds": 120}},
        "executor: liveness periodSeconds x failureThreshold (60s) must exceed",
    ),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_REFUSES))
def test_templates_refuse(chart: helm.Chart, case: str) -> None:
    values, message = TEMPLATE_REFUSES[case]
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, values)
    assert message in str(caught.value)


def test_sqlite_replicas_are_refused_even_without_the_schema(tmp_path: Path) -> None:
    # `helm install --skip-schema-validation` must still not start two SQLite writers.
    unchecked = tmp_path / "moe-lora-serve"
    shutil.copytree(CHART_DIR, unchecked)
    (unchecked / "values.schema.json").unlink()
    with helm.Chart.load(unchecked) as chart:
        assert chart.schema is None
        with pytest.raises(helm.HelmRenderError) as caught:
            render(chart, {"registry": {"replicas": 3}})
    assert "SQLite is a single-writer file" in str(caught.value)


def test_helm_install_dry_run_accepts_the_production_values(chart: helm.Chart) -> None:
    # Helm's install action (kubeVersion check, hooks, ordering), client-side only.
    with helm.Config(storage_driver="memory", namespace=NAMESPACE) as config:
        release = config.install(chart, RELEASE, ci_values("production"), dry_run="client")
    assert release["status"] == "pending-install"
    assert "kind: StatefulSet" in release["manifest"]
    assert "adapterctl upload" in release["notes"]
