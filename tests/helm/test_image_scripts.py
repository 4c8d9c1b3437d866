"""The scripts the images carry, run as the containers run them: the gRPC health probe
against a real server, the model fetcher against an S3 server (moto, over HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import grpc
import pytest
from moto.server import ThreadedMotoServer

from shared.grpc_server import GrpcServer, ServerOptions
from shared.ports import free_port
from tests.conftest import REPO

PROBE = REPO / "docker" / "grpc_health_probe.py"
FETCH = REPO / "docker" / "fetch_model.py"
SERVICE = "moelora.v1.Executor"


def run(
    script: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def health_server() -> Iterator[GrpcServer]:
    """A real server with health for SERVICE and nothing else."""

    def register(_server: grpc.Server) -> None:
        pass

    server = GrpcServer(ServerOptions(listen=f"127.0.0.1:{free_port()}"), [SERVICE], register)
    server.start()
    yield server
    server.drain()


def test_probe_passes_only_when_serving(health_server: GrpcServer) -> None:
    address = health_server.address
    health_server.set_serving(False)
    not_yet = run(PROBE, "--service", SERVICE, address)
    assert not_yet.returncode == 1
    assert f"{address} {SERVICE}: NOT_SERVING" in not_yet.stdout
    health_server.set_serving(True)
    serving = run(PROBE, "--service", SERVICE, address)
    assert serving.returncode == 0, serving.stdout + serving.stderr
    assert f"{address} {SERVICE}: SERVING" in serving.stdout


def test_probe_needs_every_address_serving(health_server: GrpcServer) -> None:
    health_server.set_serving(True)
    closed = f"127.0.0.1:{free_port()}"
    result = run(PROBE, "--service", SERVICE, "--timeout", "2", health_server.address, closed)
    assert result.returncode == 1
    assert f"{health_server.address} {SERVICE}: SERVING" in result.stdout
    assert f"{closed} {SERVICE}: UNAVAILABLE" in result.stdout


def test_probe_fails_for_a_service_the_server_lacks(health_server: GrpcServer) -> None:
    health_server.set_serving(True)
    result = run(PROBE, "--service", "moelora.v1.AdapterRegistry", health_server.address)
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stdout


def test_probe_defaults_to_its_own_container_server(health_server: GrpcServer) -> None:
    # As in the image's HEALTHCHECK: MOELORA_EXECUTOR_LISTEN says 0.0.0.0, the probe uses loopback.
    health_server.set_serving(True)
    env = {"MOELORA_EXECUTOR_LISTEN": f"0.0.0.0:{health_server.port}"}
    result = run(PROBE, env=env)
    assert result.returncode == 0
    assert f"127.0.0.1:{health_server.port} (server): SERVING" in result.stdout
    broken = run(PROBE, env={"MOELORA_REGISTRY_LISTEN": "nonsense"})
    assert broken.returncode != 0
    assert "MOELORA_REGISTRY_LISTEN='nonsense' is not host:port" in broken.stderr


# --- the model fetcher --------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "MOELORA_REGISTRY_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "MOELORA_REGISTRY_S3_REGION": "us-east-1",
        "MOELORA_REGISTRY_S3_PATH_STYLE": "true",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }
    yield env
    server.stop()


def s3_client(env: dict[str, str]) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=env["MOELORA_REGISTRY_S3_ENDPOINT_URL"],
        region_name=env["MOELORA_REGISTRY_S3_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def last_event(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    event: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return event


CHECKPOINT = {
    "config.json": b'{"model_type": "olmoe"}',
    "model-00001-of-00002.safetensors": os.urandom(300_000),
    "model-00002-of-00002.safetensors": os.urandom(1000),
    "tokenizer/tokenizer.json": b"{}",
}


def test_fetch_copies_a_checkpoint_then_only_what_changed(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    s3 = s3_client(s3_env)
    s3.create_bucket(Bucket="models")
    for name, data in CHECKPOINT.items():
        s3.put_object(Bucket="models", Key=f"tiny/{name}", Body=data)
    # A sibling whose name starts like the prefix must not come along.
    s3.put_object(Bucket="models", Key="tiny-old/config.json", Body=b"old")
    s3.put_object(Bucket="models", Key="tiny/empty-folder/", Body=b"")
    dest = tmp_path / "models"

    first = last_event(run(FETCH, "s3://models/tiny", str(dest), env=s3_env))
    assert (first["files"], first["fetched"]) == (4, 4)
    assert first["fetched_bytes"] == sum(len(d) for d in CHECKPOINT.values())
    for name, data in CHECKPOINT.items():
        assert (dest / name).read_bytes() == data
    assert sorted(p.name for p in dest.rglob("*.part")) == []

    again = last_event(run(FETCH, "s3://models/tiny/", str(dest), env=s3_env))
    assert again["fetched"] == 0

    s3.put_object(Bucket="models", Key="tiny/config.json", Body=b'{"model_type": "mixtral"}')
    (dest / "model-00002-of-00002.safetensors").write_bytes(b"truncated")
    changed = last_event(run(FETCH, "s3://models/tiny", str(dest), env=s3_env))
    assert changed["fetched"] == 2
    assert (dest / "config.json").read_bytes() == b'{"model_type": "mixtral"}'
    assert (dest / "model-00002-of-00002.safetensors").read_bytes() == CHECKPOINT[
        "model-00002-of-00002.safetensors"
    ]


def test_fetch_fails_clearly(s3_env: dict[str, str], tmp_path: Path) -> None:
    s3 = s3_client(s3_env)
    s3.create_bucket(Bucket="odd")
    nothing = run(FETCH, "s3://odd/absent", str(tmp_path / "a"), env=s3_env)
    assert nothing.returncode == 2
    assert "no objects under s3://odd/absent/" in nothing.stderr

    missing_bucket = run(FETCH, "s3://no-such-bucket/x", str(tmp_path / "b"), env=s3_env)
    assert missing_bucket.returncode == 1
    assert "NoSuchBucket" in missing_bucket.stderr

    s3.put_object(Bucket="odd", Key="m/../escape.json", Body=b"{}")
    escape = run(FETCH, "s3://odd/m", str(tmp_path / "c"), env=s3_env)
    assert escape.returncode == 1
    assert "does not map to a file below the destination" in escape.stderr
    assert not (tmp_path / "escape.json").exists()

    not_s3 = run(FETCH, "https://odd/m", str(tmp_path / "d"), env=s3_env)
    assert not_s3.returncode == 2
    assert "is not s3://BUCKET[/PREFIX]" in not_s3.stderr
