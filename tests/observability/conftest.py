"""A registry and an executor as processes with their /metrics on, under a little traffic of
every kind the dashboard shows (uploads, Forward with adapters churning through two slots,
errors, a ForwardStream, the executor's watch), and a real Prometheus scraping both; the
chart's PrometheusRule and Grafana dashboard, rendered by Helm."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import helm_python as helm
import pytest
import torch
import yaml

from moelora.client.errors import MoeLoraError
from moelora.client.executor import ExecutorClient, ForwardCall, RetryPolicy
from moelora.client.health import wait_until_serving
from moelora.client.model_spec import ModelSpec, read_model_spec
from moelora.client.registry import RegistryClient
from shared.ports import free_port
from tests.conftest import ServerProcess
from tests.helm.chart import CHART_DIR, render
from tests.observability.prometheus import Prometheus
from tests.registry.fixtures import write_adapter, write_base_model

BASE = "tiny"
#: Adapters of rank 4 (three, for two slots: the third evicts) and one the executor refuses.
ADAPTERS = ("a", "b", "c")
WIDE = "wide"
#: The labels prometheus-operator gives its targets, which the rules aggregate by.
NAMESPACE = "ml"
#: What the chart's values turn on for these tests.
MONITORING = {
    "metrics": {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}
}


@dataclass
class Stack:
    tmp: Path
    spec: ModelSpec
    registry: str
    executor: str
    #: job -> /metrics host:port
    metrics: dict[str, str]
    logs: dict[str, ServerProcess]


@dataclass
class Monitoring:
    """The chart's rendered PrometheusRule spec and dashboard."""

    rules: dict[str, Any]
    dashboard: dict[str, Any]


def _script(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@pytest.fixture(scope="package")
def monitoring() -> Monitoring:
    with helm.Chart.load(CHART_DIR) as chart:
        release = render(chart, MONITORING)
    rule = release.one("PrometheusRule")
    board = release.one("ConfigMap", "monitoring")
    return Monitoring(rule["spec"], json.loads(board["data"]["moe-lora-serve.json"]))


def _traffic(stack: Stack) -> None:
    """One call of every kind the dashboard and the alerts read."""
    layer = stack.spec.moe_layers[0]
    x = torch.randn(3, stack.spec.hidden_size)
    with (
        RegistryClient(stack.registry, timeout=30) as registry,
        ExecutorClient(stack.executor, timeout=30, retry=RetryPolicy(attempts=1)) as executor,
    ):
        executor.forward(layer, x)
        for name in (*ADAPTERS, "a"):  # two slots, three adapters: loads and an eviction
            executor.forward(layer, x, [(2, name), (1, None)])
        for ref in ("missing", WIDE):  # NOT_FOUND (registry, executor), FAILED_PRECONDITION
            with pytest.raises(MoeLoraError):
                executor.forward(layer, x, [(3, ref)])
        calls = [ForwardCall(layer, x, [(3, "b")]), ForwardCall(layer, x)]
        assert len(list(executor.forward_stream(calls))) == 2
        registry.download("a", stack.tmp / "downloaded")  # the DownloadAdapter stream


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("observed")
    base = write_base_model(tmp / "base")
    spec = read_model_spec(base)
    registry_address, executor_address = (f"127.0.0.1:{free_port()}" for _ in range(2))
    metrics = {job: f"127.0.0.1:{free_port()}" for job in ("registry", "executor")}
    processes: dict[str, ServerProcess] = {}
    try:
        processes["registry"] = ServerProcess(
            [
                _script("moelora-registry"), "--listen", registry_address,
                "--data-dir", str(tmp / "registry"), "--metrics-listen", metrics["registry"],
                "--drain-seconds", "1",
            ],
            {**_env(), "MOELORA_REGISTRY_HTTP_LISTEN": "127.0.0.1:0"},
            tmp / "registry.log",
        )  # fmt: skip
        with grpc.insecure_channel(registry_address) as channel:
            wait_until_serving(channel, "moelora.v1.AdapterRegistry", timeout=60)
        with RegistryClient(registry_address, timeout=30) as registry:
            registry.register_base_model(spec.to_proto(BASE))
            for seed, name in enumerate(ADAPTERS):
                registry.upload(write_adapter(tmp / name, seed=seed), name, BASE)
            registry.upload(write_adapter(tmp / WIDE, rank=8), WIDE, BASE)
        processes["executor"] = ServerProcess(
            [
                _script("moelora-executor"), "--listen", executor_address,
                "--base-model-path", str(base), "--base-model-name", BASE,
                "--registry-address", registry_address, "--disk-cache-dir", str(tmp / "cache"),
                "--metrics-listen", metrics["executor"], "--device", "cpu",
                "--num-slots", "2", "--max-rank", "4", "--drain-seconds", "1",
            ],
            _env(),
            tmp / "executor.log",
        )  # fmt: skip
        with grpc.insecure_channel(executor_address) as channel:
            wait_until_serving(channel, "moelora.v1.Executor", timeout=120)
        yield Stack(tmp, spec, registry_address, executor_address, metrics, processes)
    finally:
        for process in reversed(processes.values()):
            process.terminate()


@pytest.fixture(scope="package")
def prometheus(
    stack: Stack, monitoring: Monitoring, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Prometheus with the chart's rules, scraping both services; yielded once the traffic
    ran and both were scraped a few times since."""
    root = tmp_path_factory.mktemp("prometheus")
    (root / "rules.yaml").write_text(yaml.safe_dump(monitoring.rules))
    targets = {
        job: (address, {"namespace": NAMESPACE, "pod": f"{job}-0"})
        for job, address in stack.metrics.items()
    }
    server = Prometheus(root, targets, root / "rules.yaml")
    try:
        _traffic(stack)
        before = {job: server.scrapes(job) for job in targets}
        deadline = time.monotonic() + 30
        while any(server.scrapes(job) < before[job] + 3 for job in targets):
            assert time.monotonic() < deadline, server.process.log()
            time.sleep(0.5)
        yield server
    finally:
        server.stop()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}
