"""Renders the chart with Helm's own engine (helm-python-sdk, offline) and gives the
tests the rendered objects as dicts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import helm_python as helm
import yaml

from tests.conftest import REPO

CHART_DIR = REPO / "helm" / "moe-lora-serve"
RELEASE = "demo"
NAMESPACE = "ml"
# The Kubernetes versions whose API schemas the manifests must satisfy: the chart's
# floor (Chart.yaml kubeVersion: gRPC probes, the preStop sleep action) and the newest
# the pinned kubernetes-validate ships.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
REGISTRY_SERVICE = "moelora.v1.AdapterRegistry"
EXECUTOR_SERVICE = "moelora.v1.Executor"

Obj = dict[str, Any]


def ci_values(name: str) -> dict[str, Any]:
    """The chart's ci/NAME-values.yaml, parsed by Helm."""
    return helm.values_from_yaml((CHART_DIR / "ci" / f"{name}-values.yaml").read_text())


def ci_value_names() -> list[str]:
    return sorted(p.name.removesuffix("-values.yaml") for p in CHART_DIR.glob("ci/*-values.yaml"))


@dataclass(frozen=True)
class Release:
    """One rendering of the chart."""

    objects: list[Obj]
    notes: str

    def all(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> Obj:
        found = [o for o in self.all(kind) if component is None or component_of(o) == component]
        assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
        return found[0]

    def named(self, kind: str, name: str) -> Obj:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} named {name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[Obj]:
        """Objects that run pods: Deployments, StatefulSets, Jobs, and bare Pods."""
        return [o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet", "Job", "Pod")]


def render(
    chart: helm.Chart, values: dict[str, Any] | None = None, release: str = RELEASE
) -> Release:
    manifests = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
    objects: list[Obj] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
        else:
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return Release(objects, notes)


def component_of(obj: Obj) -> str:
    return str(obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", ""))


def pod_template(workload: Obj) -> Obj:
    """The pod a workload runs: metadata and spec."""
    if workload["kind"] == "Pod":
        return workload
    return dict(workload["spec"]["template"])


def containers(workload: Obj) -> Iterator[Obj]:
    spec = pod_template(workload)["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def container(workload: Obj, name: str) -> Obj:
    found = [c for c in containers(workload) if c["name"] == name]
    assert len(found) == 1, f"no container {name} in {workload['metadata']['name']}"
    return found[0]


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[op]
        if not ok:
            return False
    return True


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def configmap_env(release: Release, c: Obj) -> dict[str, str]:
    """The variables a container gets from the ConfigMaps it names in envFrom."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(release.named("ConfigMap", name)["data"])
    return env


def container_env(
    release: Release, c: Obj, secrets: dict[tuple[str, str], str], pod_name: str = ""
) -> dict[str, str]:
    """Every variable the container starts with, as the kubelet would resolve them:
    its ConfigMaps, then its own entries, with Secret references looked up in
    ``secrets`` ((name, key) -> value) and the pod's name where a field refers to it."""
    env = configmap_env(release, c)
    for name, entry in env_of(c).items():
        if "value" in entry:
            env[name] = str(entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[name] = pod_name
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[name] = secrets[(ref["name"], ref["key"])]
    return env
