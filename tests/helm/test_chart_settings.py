"""The environment the chart gives each container is one its service accepts, and
means what the values say (parsed by the services' own settings classes)."""

from __future__ import annotations

from typing import TypeVar

import pytest

from executor_service.config import ExecutorSettings
from registry_service.config import RegistrySettings
from shared.config import ServiceSettings, parse_settings
from tests.helm.chart import Release, container, container_env

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
