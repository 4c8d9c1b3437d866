"""The chart's extension points and monitoring objects: extra volumes, mounts, init and
sidecar containers, common annotations, the monitors' scrape settings, the Grafana dashboard
ConfigMap and the PrometheusRule (whose queries tests/observability runs against Prometheus)."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.helm.chart import CHART_DIR, Release, component_of, pod_template, render

EXTRA: dict[str, Any] = {
    "extraVolumes": [{"name": "certs", "secret": {"secretName": "corp-ca"}}],
    "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/corp-ca", "readOnly": True}],
    "initContainers": [{"name": "wait-for-dns", "image": "busybox:1.37", "command": ["true"]}],
    "extraContainers": [{"name": "log-shipper", "image": "fluent-bit:4.0"}],
}


@pytest.fixture(scope="module")
def extended(chart: helm.Chart) -> Release:
    return render(
        chart,
        {
            "commonAnnotations": {"owner": "ml-platform"},
            "commonLabels": {"team": "ml"},
            "registry": EXTRA,
            "executor": {**EXTRA, "groups": [{"name": "a", "layers": "0-1"}]},
        },
    )


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet"])
def test_extension_points_reach_the_pods(extended: Release, kind: str) -> None:
    for workload in extended.all(kind):
        spec = pod_template(workload)["spec"]
        main = spec["containers"][0]
        assert [c["name"] for c in spec["containers"]] == [main["name"], "log-shipper"]
        assert spec["initContainers"][-1]["name"] == "wait-for-dns"
        assert {"name": "certs", "secret": {"secretName": "corp-ca"}} in spec["volumes"]
        assert main["volumeMounts"][-1] == EXTRA["extraVolumeMounts"][0]
        mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounted <= {v["name"] for v in spec["volumes"]}


def test_an_s3_model_fetch_still_runs_first(chart: helm.Chart) -> None:
    model = {"source": "s3", "s3": {"url": "s3://models/qwen"}}
    release = render(chart, {"executor": {**EXTRA, "model": model}})
    init = pod_template(release.one("StatefulSet"))["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["fetch-model", "wait-for-dns"]


def test_common_annotations_reach_every_object_and_keep_their_own(extended: Release) -> None:
    for obj in extended.objects:
        assert obj["metadata"]["annotations"]["owner"] == "ml-platform", obj["metadata"]["name"]
    hook = extended.one("Pod", "test")["metadata"]["annotations"]
    assert hook["helm.sh/hook"] == "test"


def test_common_labels_reach_every_object_and_pod_but_no_selector(extended: Release) -> None:
    """Selectors are immutable on a Deployment or StatefulSet: a label added to them would
    make the next upgrade fail, so commonLabels stay out of them."""
    for obj in extended.objects:
        assert obj["metadata"]["labels"]["team"] == "ml", obj["metadata"]["name"]
    for kind in ("Deployment", "StatefulSet"):
        for workload in extended.all(kind):
            assert pod_template(workload)["metadata"]["labels"]["team"] == "ml"
            assert "team" not in workload["spec"]["selector"]["matchLabels"]
    for service in extended.all("Service"):
        assert "team" not in service["spec"].get("selector", {})


def test_without_annotations_objects_carry_none(defaults: Release) -> None:
    unannotated = [o for o in defaults.objects if o["kind"] in ("ConfigMap", "Service")]
    assert unannotated and all("annotations" not in o["metadata"] for o in unannotated)


def test_monitors_take_scrape_timeout_and_relabelings(production: Release) -> None:
    for monitor in production.all("ServiceMonitor"):
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["scrapeTimeout"] == "10s"
        assert endpoint["relabelings"] == [{"targetLabel": "cluster", "replacement": "gpu-east"}]
        assert "metricRelabelings" not in endpoint


def test_the_dashboard_configmap_is_for_grafanas_sidecar(production: Release) -> None:
    board = production.one("ConfigMap", "monitoring")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["annotations"] == {"grafana_folder": "moe-lora-serve"}
    dashboard = json.loads(board["data"]["moe-lora-serve.json"])
    assert dashboard["uid"] == "moe-lora-serve" and dashboard["panels"]
    on_disk = json.loads((CHART_DIR / "dashboards" / "moe-lora-serve.json").read_text())
    assert dashboard == on_disk


def test_the_prometheus_rule_carries_the_selectors_labels(production: Release) -> None:
    rule = production.one("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert component_of(rule) == "monitoring"
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert "MoeLoraExecutorNotServing" in alerts and len(alerts) == len(set(alerts))


def test_thresholds_come_from_the_values(chart: helm.Chart) -> None:
    values = {"metrics": {"prometheusRule": {"enabled": True, "forwardP99Seconds": 0.05}}}
    rule = render(chart, values).one("PrometheusRule")
    slow = next(r for g in rule["spec"]["groups"] for r in g["rules"]
                if r["alert"] == "MoeLoraForwardSlow")  # fmt: skip
    assert slow["expr"].endswith("> 0.05")


def test_monitoring_objects_are_off_by_default(defaults: Release) -> None:
    assert defaults.all("PrometheusRule") == []
    assert [c for c in defaults.all("ConfigMap") if component_of(c) == "monitoring"] == []


def test_chart_metadata_names_home_and_sources() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert meta["home"].startswith("https://") and meta["sources"]


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"registry": {"extraVolumes": [{"emptyDir": {}}]}}, "/registry/extraVolumes/0"),
        ({"executor": {"extraContainers": {"name": "x"}}}, "/executor/extraContainers"),
        ({"metrics": {"serviceMonitor": {"scrapeTimeout": "ten"}}}, "scrapeTimeout"),
        ({"metrics": {"prometheusRule": {"forwardErrorRatio": 2}}}, "forwardErrorRatio"),
        ({"commonAnnotations": {"a": 1}}, "/commonAnnotations/a"),
    ],
)
def test_the_schema_refuses_malformed_extensions(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(chart, values)
    assert where in str(caught.value)
