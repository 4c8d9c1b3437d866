"""The registry runs from exactly the configuration the chart renders: the migration
Job's command and environment, then the Deployment's, on SQLite and on PostgreSQL +
S3 (moto) with auth; `helm test`'s probe then finds it SERVING. Only what a pod
cannot have here is moved: listen ports to free loopback ports, paths under tmp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.conftest import REPO, free_port, wait_for
from tests.helm.chart import Release, container, container_env
from tests.registry.conftest import pg_schema_url, s3_endpoint

# The registry tests' fixtures: a PostgreSQL schema of its own, moto's S3 server.
__all__ = ["pg_schema_url", "s3_endpoint"]

PROBE = REPO / "docker" / "grpc_health_probe.py"
BIN = Path(sys.executable).parent
AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}


def relocate(env: dict[str, str], tmp: Path) -> dict[str, str]:
    """The pod's environment, runnable here: free loopback ports, volumes under tmp."""
    moved = {}
    for name, value in env.items():
        if name in ("MOELORA_LISTEN", "MOELORA_METRICS_LISTEN") and value:
            value = f"127.0.0.1:{free_port()}"
        for mount in ("/data", "/etc/moelora/auth"):
            value = value.replace(mount, f"{tmp}{mount}")
        moved[name] = value
    return moved


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without MOELORA_* and AWS_*, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MOELORA_", "AWS_"))}
    return {**base, "PYTHONUNBUFFERED": "1", **env}


def probe_serving(address: str) -> bool:
    result = subprocess.run(
        [sys.executable, str(PROBE), "--service=moelora.v1.AdapterRegistry", address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.returncode == 0


def serve_and_check(start_server: Any, env: dict[str, str]) -> Any:
    server = start_server("moelora-registry", "serve", env=env)
    address = env["MOELORA_LISTEN"]
    try:
        wait_for(lambda: server.proc.poll() is not None or probe_serving(address), timeout=60)
    except TimeoutError:
        pytest.fail(f"registry not SERVING:\n{server.log()}")
    assert server.proc.poll() is None, server.log()
    metrics = urllib.request.urlopen(f"http://{env['MOELORA_METRICS_LISTEN']}/metrics").read()
    # The probe's health checks went through the server's RPC metrics.
    health_ok = b'code="OK",method="/grpc.health.v1.Health/Check"'
    assert b"moelora_grpc_server_handled_total{" + health_ok in metrics
    return server


def test_sqlite_registry_runs_from_the_default_configuration(
    defaults: Release, start_server: Any, tmp_path: Path
) -> None:
    pod = container(defaults.one("Deployment", "registry"), "registry")
    assert pod["args"] == ["serve"]
    env = clean_env(relocate(container_env(defaults, pod, {}), tmp_path))
    server = serve_and_check(start_server, env)
    assert (tmp_path / "data" / "registry.db").exists()
    assert server.terminate() == 0


@pytest.mark.postgres
def test_production_registry_migrates_in_the_job_then_serves_with_auth(
    production: Release,
    start_server: Any,
    tmp_path: Path,
    pg_schema_url: str,
    s3_endpoint: str,
) -> None:
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS["AWS_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket="moelora-adapters")
    secrets = {
        ("moelora-database", "database-url"): pg_schema_url,
        ("moelora-s3", "AWS_ACCESS_KEY_ID"): AWS["AWS_ACCESS_KEY_ID"],
        ("moelora-s3", "AWS_SECRET_ACCESS_KEY"): AWS["AWS_SECRET_ACCESS_KEY"],
    }

    # The hook Job, twice: an upgrade runs it again on a migrated database.
    job = container(production.one("Job", "migration"), "migrate")
    job_env = clean_env(relocate(container_env(production, job, secrets), tmp_path))
    for _ in range(2):
        done = subprocess.run(
            [str(BIN / "moelora-registry"), *job["args"]],
            env=job_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.strip().splitlines()[-1])["revision"]

    # The token file the auth Secret would hold, where the chart mounts it.
    made = subprocess.run(
        [str(BIN / "moelora-registry"), "hash-token", "ci", "write"],
        capture_output=True,
        text=True,
        check=True,
        env=clean_env({}),
    )
    minted = json.loads(made.stdout)
    auth_dir = tmp_path / "etc" / "moelora" / "auth"
    auth_dir.mkdir(parents=True)
    (auth_dir / "tokens.json").write_text(json.dumps({"tokens": [minted["entry"]]}))

    pod = container(production.one("Deployment", "registry"), "registry")
    env = relocate(container_env(production, pod, secrets), tmp_path)
    env["MOELORA_S3_ENDPOINT_URL"] = s3_endpoint  # the only address moved off the cluster
    env = clean_env(env)
    assert env["MOELORA_MIGRATE_ON_START"] == "false"
    server = serve_and_check(start_server, env)

    def adapterctl(token: str | None) -> subprocess.CompletedProcess[str]:
        args = [str(BIN / "adapterctl"), "--address", env["MOELORA_LISTEN"], "list"]
        extra = {"MOELORA_REGISTRY_TOKEN": token} if token else {}
        return subprocess.run(
            args, env=clean_env(extra), capture_output=True, text=True, timeout=60
        )

    allowed = adapterctl(minted["token"])
    assert allowed.returncode == 0, allowed.stderr
    refused = adapterctl(None)
    assert refused.returncode == 6, refused.stderr  # UNAUTHENTICATED
    assert server.terminate() == 0
