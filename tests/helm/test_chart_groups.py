"""Executor groups (executor.groups): each renders its own StatefulSet, headless Service
and PodDisruptionBudget whose pods serve only the group's layers; without groups the
chart renders the single executor it always did."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from executor_service.config import ExecutorSettings
from moelora.client.layer_set import parse_layers
from shared.config import parse_settings
from tests.helm.chart import (
    Obj,
    Release,
    ci_values,
    container,
    container_env,
    env_of,
    pod_template,
    render,
    selector_matches,
)

GROUPS: list[dict[str, Any]] = [
    {"name": "a", "layers": "0-23", "replicas": 2},
    {"name": "b", "layers": "24-47,60", "replicas": 3},
    {"name": "c", "layers": "48-59", "gpu": {"count": 2}, "nodeSelector": {"pool": "big"}},
]
EXECUTOR = "demo-moe-lora-serve-executor"
GROUP_LABEL = "moelora.io/executor-group"


@pytest.fixture(scope="module")
def grouped(chart: helm.Chart) -> Release:
    return render(chart, {"executor": {"replicas": 1, "groups": GROUPS}})


def pod_labels(workload: Obj) -> dict[str, str]:
    return dict(pod_template(workload)["metadata"]["labels"])


def test_each_group_is_a_statefulset_with_its_service_and_budget(grouped: Release) -> None:
    names = [f"{EXECUTOR}-{g['name']}" for g in GROUPS]
    assert [s["metadata"]["name"] for s in grouped.all("StatefulSet")] == names
    assert [p["metadata"]["name"] for p in grouped.all("PodDisruptionBudget")] == names
    services = [s for s in grouped.all("Service") if s["spec"].get("clusterIP") == "None"]
    assert [s["metadata"]["name"] for s in services] == [f"{n}-headless" for n in names]
    # One ConfigMap, ServiceAccount and NetworkPolicy serve every group.
    assert len([c for c in grouped.all("ConfigMap") if c["metadata"]["name"] == EXECUTOR]) == 1
    keys = [(o["kind"], o["metadata"]["name"]) for o in grouped.objects]
    assert len(keys) == len(set(keys))


def test_services_and_budgets_select_exactly_their_groups_pods(grouped: Release) -> None:
    statefulsets = grouped.all("StatefulSet")
    for statefulset in statefulsets:
        name = statefulset["metadata"]["name"]
        service = grouped.named("Service", statefulset["spec"]["serviceName"])
        pdb = grouped.named("PodDisruptionBudget", name)
        assert pdb["spec"]["maxUnavailable"] == 1
        assert selector_matches(statefulset["spec"]["selector"], pod_labels(statefulset))
        for other in statefulsets:
            mine = other is statefulset
            labels = pod_labels(other)
            assert selector_matches({"matchLabels": service["spec"]["selector"]}, labels) == mine
            assert selector_matches(pdb["spec"]["selector"], labels) == mine
    # The NetworkPolicy (component=executor) admits clients to every group.
    policy = grouped.named("NetworkPolicy", EXECUTOR)
    assert all(selector_matches(policy["spec"]["podSelector"], pod_labels(s)) for s in statefulsets)


def test_group_pods_serve_their_layers_under_their_pod_names(
    grouped: Release, monkeypatch: pytest.MonkeyPatch
) -> None:
    for group in GROUPS:
        statefulset = grouped.named("StatefulSet", f"{EXECUTOR}-{group['name']}")
        executor = container(statefulset, "executor")
        assert env_of(executor)["MOELORA_EXECUTOR_LAYERS"] == {
            "name": "MOELORA_EXECUTOR_LAYERS",
            "value": group["layers"],
        }
        pod = f"{statefulset['metadata']['name']}-1"
        env = container_env(grouped, executor, {}, pod_name=pod)
        # The executor's own settings class reads what the pod would start with.
        for name in ExecutorSettings.env_names().values():
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        settings = parse_settings(ExecutorSettings, [])
        assert settings.layer_set == parse_layers(group["layers"])
        assert settings.replica_name == pod


def test_groups_override_replicas_gpus_and_placement(grouped: Release) -> None:
    a, b, c = grouped.all("StatefulSet")
    assert [s["spec"]["replicas"] for s in (a, b, c)] == [2, 3, 1]  # c: executor.replicas
    gpus = [container(s, "executor")["resources"]["limits"]["nvidia.com/gpu"] for s in (a, b, c)]
    assert gpus == [1, 1, 2]  # c keeps executor.gpu.resourceName
    assert pod_template(c)["spec"]["nodeSelector"] == {"pool": "big"}
    assert "nodeSelector" not in pod_template(a)["spec"]


def test_helm_test_checks_every_pod_of_every_group(grouped: Release) -> None:
    args = container(grouped.one("Pod", "test"), "executor-health")["args"]
    pods = [
        f"{EXECUTOR}-{g['name']}-{i}.{EXECUTOR}-{g['name']}-headless.ml.svc:50052"
        for g in GROUPS
        for i in range(g.get("replicas", 1))
    ]
    assert args[1:] == pods


def test_no_groups_renders_the_single_executor(chart: helm.Chart, defaults: Release) -> None:
    assert render(chart, {"executor": {"groups": []}}).objects == defaults.objects
    statefulset = defaults.one("StatefulSet")
    assert statefulset["metadata"]["name"] == EXECUTOR
    assert statefulset["spec"]["serviceName"] == f"{EXECUTOR}-headless"
    assert GROUP_LABEL not in pod_labels(statefulset)
    env = env_of(container(statefulset, "executor"))
    assert "MOELORA_EXECUTOR_LAYERS" not in env and "MOELORA_EXECUTOR_REPLICA_NAME" not in env


def test_qwen3_235b_groups_cover_every_moe_layer_once(chart: helm.Chart) -> None:
    release = render(chart, ci_values("qwen3-235b"))
    served: list[int] = []
    for statefulset in release.all("StatefulSet"):
        layers = env_of(container(statefulset, "executor"))["MOELORA_EXECUTOR_LAYERS"]["value"]
        served += parse_layers(layers)
    assert sorted(served) == list(range(94))
    assert len(release.all("PodDisruptionBudget")) == 4


def test_group_names_fit_kubernetes_limits_for_the_longest_names(chart: helm.Chart) -> None:
    groups = [{"name": "g" * 20, "layers": "0-1"}, {"name": "h" * 20, "layers": "2-3"}]
    release = render(chart, {"executor": {"groups": groups}}, release="r" * 53)
    for obj in release.objects:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    names = [s["metadata"]["name"] for s in release.all("StatefulSet")]
    assert all(len(n) <= 52 for n in names) and len(set(names)) == 2


# (group, what the schema error must name)
SCHEMA_REFUSES: dict[str, tuple[dict[str, Any], str]] = {
    "name not a DNS label": ({"name": "Layers_A", "layers": "0-3"}, "/executor/groups/0/name"),
    "name too long": ({"name": "g" * 21, "layers": "0-3"}, "/executor/groups/0/name"),
    "layers not ranges": ({"name": "a", "layers": "0..3"}, "/executor/groups/0/layers"),
    "layers empty part": ({"name": "a", "layers": "0-3,"}, "/executor/groups/0/layers"),
    "no layers": ({"name": "a"}, "/executor/groups/0"),
    "no replicas": ({"name": "a", "layers": "0-3", "replicas": 0}, "/executor/groups/0/replicas"),
    "unknown key": ({"name": "a", "layers": "0-3", "numSlots": 4}, "numSlots"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_REFUSES))
def test_schema_refuses_a_bad_group(chart: helm.Chart, case: str) -> None:
    group, where = SCHEMA_REFUSES[case]
    with pytest.raises(helm.HelmValuesError) as caught:
        render(chart, {"executor": {"groups": [group]}})
    assert where in str(caught.value)


TEMPLATE_REFUSES: dict[str, tuple[dict[str, Any], str]] = {
    "a name twice": (
        {"groups": [{"name": "a", "layers": "0-3"}, {"name": "a", "layers": "4-7"}]},
        'the name "a" is used twice',
    ),
    "groups with autoscaling": (
        {"groups": [{"name": "a", "layers": "0-3"}], "autoscaling": {"enabled": True}},
        "executor.autoscaling is for the single executor",
    ),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_REFUSES))
def test_templates_refuse_groups_they_cannot_render(chart: helm.Chart, case: str) -> None:
    values, message = TEMPLATE_REFUSES[case]
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"executor": values})
    assert message in str(caught.value)
