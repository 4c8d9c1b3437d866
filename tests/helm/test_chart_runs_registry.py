"""The registry runs from exactly the configuration the chart renders: the migration
Job's command and environment (twice: upgrades rerun it), then the Deployment's, on
PostgreSQL + S3 (moto) with auth, and on the default SQLite; `helm test`'s probe then
finds it SERVING."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart import REGISTRY_SERVICE, Release, container, container_env
from tests.helm.local_pods import AWS, BIN, clean_env, relocate, s3_client, start_serving

# The registry tests' fixtures: a PostgreSQL schema of its own, moto's S3 server.


def test_sqlite_registry_runs_from_the_default_configuration(
    defaults: Release, start_server: Any, tmp_path: Path
) -> None:
    pod = container(defaults.one("Deployment", "registry"), "registry")
    assert pod["args"] == ["serve"]
    env = clean_env(relocate(container_env(defaults, pod, {}), tmp_path))
    server = start_serving(start_server, ["moelora-registry", *pod["args"]], REGISTRY_SERVICE, env)
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
    s3_client(s3_endpoint).create_bucket(Bucket="moelora-adapters")
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
    env["MOELORA_REGISTRY_S3_ENDPOINT_URL"] = s3_endpoint  # the only address moved off the cluster
    env = clean_env(env)
    assert env["MOELORA_REGISTRY_MIGRATE_ON_START"] == "false"
    server = start_serving(start_server, ["moelora-registry", *pod["args"]], REGISTRY_SERVICE, env)

    def adapterctl(token: str | None) -> subprocess.CompletedProcess[str]:
        args = [str(BIN / "adapterctl"), "--address", env["MOELORA_REGISTRY_LISTEN"], "list"]
        extra = {"MOELORA_REGISTRY_TOKEN": token} if token else {}
        return subprocess.run(
            args, env=clean_env(extra), capture_output=True, text=True, timeout=60
        )

    allowed = adapterctl(minted["token"])
    assert allowed.returncode == 0, allowed.stderr
    refused = adapterctl(None)
    assert refused.returncode == 6, refused.stderr  # UNAUTHENTICATED
    assert server.terminate() == 0
