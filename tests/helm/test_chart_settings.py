"""The environment the chart gives each container is one its service accepts, and
means what the values say (parsed by the services' own settings classes)."""

from __future__ import annotations

from typing import TypeVar

import helm_python as helm
import kubernetes_validate
import pytest

from executor_service.config import ExecutorSettings
from registry_service.config import RegistrySettings
from shared.config import ServiceSettings, parse_settings
from tests.helm.chart import (
    KUBE_VERSIONS,
    Release,
    configmap_env,
    container,
    container_env,
    env_of,
    render,
)

S = TypeVar("S", bound=ServiceSettings)

SECRETS = {
    ("moelora-database", "database-url"): "postgresql+psycopg://u:p@db:5432/moelora",
    ("moelora-executor-token", "token"): "executor-token",
    ("moelora-s3", "AWS_ACCESS_KEY_ID"): "id",
    ("moelora-s3", "AWS_SECRET_ACCESS_KEY"): "secret",
    ("minio-credentials", "AWS_ACCESS_KEY_ID"): "id",
    ("minio-credentials", "AWS_SECRET_ACCESS_KEY"): "secret",
}


def parsed(cls: type[S], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> S:
    """Settings as the service builds them at start-up from exactly ``env``."""
    for name in cls.env_names().values():
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return parse_settings(cls, [])


@pytest.mark.parametrize("release_name", ["defaults", "production", "autoscaling", "cpu"])
def test_services_accept_the_rendered_environment(
    request: pytest.FixtureRequest, release_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    release: Release = request.getfixturevalue(release_name)
    registry = container(release.one("Deployment", "registry"), "registry")
    parsed(RegistrySettings, container_env(release, registry, SECRETS), monkeypatch)
    executor = container(release.one("StatefulSet"), "executor")
    parsed(ExecutorSettings, container_env(release, executor, SECRETS), monkeypatch)


def test_production_settings_mean_what_the_values_say(
    production: Release, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry_pod = container(production.one("Deployment", "registry"), "registry")
    registry = parsed(
        RegistrySettings, container_env(production, registry_pod, SECRETS), monkeypatch
    )
    assert registry.listen == "0.0.0.0:50051"
    assert registry.metrics_listen == "0.0.0.0:9401"
    assert registry.database_url == "postgresql+psycopg://u:p@db:5432/moelora"
    assert registry.blob_url == "s3://moelora-adapters/prod"
    assert registry.s3_endpoint_url == "https://minio.storage.svc:9000"
    assert (registry.s3_region, registry.s3_path_style) == ("us-east-1", True)
    assert (registry.auth, str(registry.auth_tokens_file)) == (
        "on",
        "/etc/moelora/auth/tokens.json",
    )
    assert registry.migrate_on_start is False
    assert registry.drain_seconds == 30.0

    executor_pod = container(production.one("StatefulSet"), "executor")
    executor = parsed(
        ExecutorSettings, container_env(production, executor_pod, SECRETS), monkeypatch
    )
    assert executor.listen == "0.0.0.0:50052"
    assert str(executor.base_model_path) == "/models"
    assert executor.base_model_name == "qwen3-30b-a3b"
    assert (executor.device, executor.dtype) == ("cuda", "bfloat16")
    assert (executor.num_slots, executor.max_rank) == (32, 64)
    assert executor.host_cache_bytes == 32 * 1024**3
    assert executor.disk_cache_bytes == 100 * 1024**3
    assert executor.preload_adapters == ["support-bot@prod", "sql-writer@prod"]
    assert executor.registry_address == "demo-moe-lora-serve-registry.ml.svc:50051"
    assert executor.registry_token == "executor-token"
    # The tokens it accepts: the registry's file, mounted from the same Secret.
    assert (executor.auth, str(executor.auth_tokens_file)) == (
        "on",
        "/etc/moelora/auth/tokens.json",
    )
    volumes = production.one("StatefulSet")["spec"]["template"]["spec"]["volumes"]
    tokens = next(v for v in volumes if v["name"] == "auth-tokens")
    assert tokens["secret"]["secretName"] == "moelora-registry-tokens"
    assert executor.drain_seconds == 60.0
    assert executor.frontend_arena_pinned_bytes == 128 * 1024**2


def test_metrics_off_reaches_the_services(cpu: Release, monkeypatch: pytest.MonkeyPatch) -> None:
    executor_pod = container(cpu.one("StatefulSet"), "executor")
    executor = parsed(ExecutorSettings, container_env(cpu, executor_pod, SECRETS), monkeypatch)
    assert executor.metrics_listen == ""
    assert executor.device == "cpu"
    # auth.enabled false says off outright: on 0.0.0.0, auto would refuse to start.
    assert (executor.auth, executor.auth_tokens_file) == ("off", None)


NETWORK_CHANNEL_HOST = "MOELORA_EXECUTOR_NETWORK_CHANNEL_HOST"
NETWORK_CHANNEL_SETTINGS = {
    "MOELORA_EXECUTOR_NETWORK_CHANNEL_PORT",
    "MOELORA_EXECUTOR_MAX_NETWORK_CHANNELS",
    "MOELORA_EXECUTOR_NETWORK_CHANNEL_BUFFER_BYTES",
    NETWORK_CHANNEL_HOST,
}


@pytest.fixture(scope="module")
def network_channels(chart: helm.Chart) -> Release:
    """Network channels on, on a port and a channel count of their own."""
    channels = {"enabled": True, "port": 50070, "maxChannels": 32, "bufferMiB": 128}
    values = {"executor": {"networkChannels": channels}}
    return render(chart, values)


def test_network_channels_reach_the_executor_at_its_pod_ip(
    network_channels: Release, defaults: Release, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor_pod = container(network_channels.one("StatefulSet"), "executor")
    data = network_channels.one("ConfigMap", "executor")["data"]
    assert data["MOELORA_EXECUTOR_NETWORK_CHANNEL_PORT"] == "50070"
    assert data["MOELORA_EXECUTOR_MAX_NETWORK_CHANNELS"] == "32"
    assert data["MOELORA_EXECUTOR_NETWORK_CHANNEL_BUFFER_BYTES"] == str(128 * 1024**2)
    # The address clients on other nodes are told: the pod's own IP, from the downward API.
    host = env_of(executor_pod)[NETWORK_CHANNEL_HOST]
    assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "channels", "containerPort": 50070, "protocol": "TCP"} in executor_pod["ports"]

    # As the kubelet resolves it, with the pod IP filled in.
    without_host = dict(executor_pod)
    without_host["env"] = [e for e in executor_pod["env"] if e["name"] != NETWORK_CHANNEL_HOST]
    env = container_env(network_channels, without_host, SECRETS)
    env[NETWORK_CHANNEL_HOST] = "10.4.2.17"
    executor = parsed(ExecutorSettings, env, monkeypatch)
    assert (executor.network_channel_host, executor.network_channel_port) == ("10.4.2.17", 50070)
    assert executor.max_network_channels == 32
    assert executor.network_channel_buffer_bytes == 128 * 1024**2

    # The executor's policy admits its labelled clients on every port, both ways (the store's
    # and NCCL's ports are ephemeral); by default only on gRPC.
    client_peer = {"podSelector": {"matchLabels": {"moelora.io/executor-client": "true"}}}
    spec = network_channels.one("NetworkPolicy", "executor")["spec"]
    assert {"from": [client_peer]} in spec["ingress"]
    assert {"to": [client_peer]} in spec["egress"]
    default_spec = defaults.one("NetworkPolicy", "executor")["spec"]
    assert all("ports" in rule for rule in default_spec["ingress"])
    assert not any(rule.get("to") == [client_peer] for rule in default_spec["egress"])

    rendered = (
        network_channels.one("StatefulSet"),
        network_channels.one("NetworkPolicy", "executor"),
        network_channels.one("ConfigMap", "executor"),
    )
    for obj in rendered:
        for kube_version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_network_channels_are_off_by_default(
    defaults: Release, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor_pod = container(defaults.one("StatefulSet"), "executor")
    assert not NETWORK_CHANNEL_SETTINGS & configmap_env(defaults, executor_pod).keys()
    assert not NETWORK_CHANNEL_SETTINGS & env_of(executor_pod).keys()
    assert "channels" not in {p["name"] for p in executor_pod["ports"]}
    executor = parsed(ExecutorSettings, container_env(defaults, executor_pod, SECRETS), monkeypatch)
    assert executor.network_channel_port is None


@pytest.mark.parametrize("port", [0, 65536])
def test_schema_refuses_a_network_channel_port_out_of_range(chart: helm.Chart, port: int) -> None:
    values = {"executor": {"networkChannels": {"enabled": True, "port": port}}}
    with pytest.raises(helm.HelmValuesError) as caught:
        render(chart, values)
    assert "/executor/networkChannels/port" in str(caught.value)
