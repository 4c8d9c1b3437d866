"""The chart lints clean and every object it renders, for every values file, is one
the Kubernetes API would accept (its OpenAPI schema, strict: unknown fields fail)."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.helm.chart import (
    CHART_DIR,
    KUBE_VERSIONS,
    NAMESPACE,
    Obj,
    Release,
    ci_value_names,
    ci_values,
    container,
    render,
)

# prometheus-operator CRDs: kubernetes-validate has no schemas for them; the object tests
# check the monitors' selectors and ports, and tests/observability the rules with promtool.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
VALUES_FILES = ["defaults", *ci_value_names()]


def values_for(name: str) -> dict[str, Any]:
    return {} if name == "defaults" else ci_values(name)


def validate(obj: Obj, kube_version: str = KUBE_VERSIONS[-1]) -> None:
    kubernetes_validate.validate(obj, kube_version, strict=True)


def test_ci_values_files_are_the_expected_ones() -> None:
    assert ci_value_names() == ["autoscaling", "cpu", "production", "qwen3-235b"]


def test_the_oldest_version_checked_is_the_charts_floor(chart: helm.Chart) -> None:
    assert chart.metadata["kubeVersion"] == f">={KUBE_VERSIONS[0]}-0"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", VALUES_FILES)
def test_lint_reports_no_warning_or_error(values_name: str, kube_version: str) -> None:
    report = helm.lint(
        CHART_DIR,
        values_for(values_name),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{kube_version}",
    )
    # Severity 1 is informational ("icon is recommended"); 2 warning, 3 error.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [] and report["errors"] == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", VALUES_FILES)
def test_every_manifest_satisfies_the_kubernetes_schema(
    chart: helm.Chart, values_name: str, kube_version: str
) -> None:
    release = render(chart, values_for(values_name))
    kinds = set()
    for obj in release.objects:
        kinds.add(obj["kind"])
        assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]
        if obj["kind"] in CUSTOM_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        try:
            validate(obj, kube_version)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Pod"} <= kinds


def test_names_are_unique_per_kind(production: Release) -> None:
    keys = [(o["kind"], o["metadata"]["name"]) for o in production.objects]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("break_it", "field"),
    [
        # A named port where gRPC probes need a number.
        (lambda c: c["startupProbe"]["grpc"].__setitem__("port", "grpc"), "port"),
        # A typo in a field name: strict schemas refuse unknown fields.
        (lambda c: c.__setitem__("volumeMount", []), "volumeMount"),
    ],
)
def test_the_validator_catches_what_kubernetes_would_reject(
    defaults: Release, break_it: Any, field: str
) -> None:
    # Proves the validation above can fail: a broken copy of a real manifest.
    statefulset = copy.deepcopy(defaults.one("StatefulSet"))
    validate(statefulset)
    break_it(container(statefulset, "executor"))
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        validate(statefulset)
    assert field in str(caught.value.message) or field in [str(p) for p in caught.value.path]
