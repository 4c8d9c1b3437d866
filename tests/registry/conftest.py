"""Registry test fixtures: databases (SQLite, PostgreSQL in a schema of its own),
blob stores (a local folder, moto's S3 server over HTTP), a registry in-process
behind a real gRPC server on 127.0.0.1, and a tiny registered base model."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import grpc
import pytest

from moelora.client.health import wait_until_serving
from moelora.client.model_spec import read_model_spec
from moelora.client.registry import RegistryClient
from registry_service.app import RegistryApp, open_registry
from registry_service.config import RegistrySettings
from registry_service.server import SERVICE_NAME, create_server
from shared.grpc_server import GrpcServer
from shared.ports import free_port
from tests.registry.fixtures import write_base_model

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BASE = "tiny-qwen3"


@pytest.fixture(scope="session", autouse=True)
def aws_credentials() -> Iterator[None]:
    """Fake credentials for moto, for this process and the servers it starts."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in AWS_ENV.items():
            mp.setenv(key, value)
        yield


def new_bucket(endpoint: str) -> str:
    name = f"adapters-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    url: str = request.getfixturevalue("pg_schema_url")
    return url


@dataclass(frozen=True)
class BlobSetting:
    """Settings that choose a blob store, and where a test can look at it."""

    kind: str
    settings: dict[str, Any]

    def flags(self) -> list[str]:
        out = []
        for key, value in self.settings.items():
            flag = "--" + key.replace("_", "-")
            out += [flag] if value is True else [flag, str(value)]
        return out


@pytest.fixture(params=["local", "s3"])
def blob_setting(request: pytest.FixtureRequest, tmp_path: Path) -> BlobSetting:
    if request.param == "local":
        return BlobSetting("local", {"blob_url": f"file://{tmp_path / 'blobs'}"})
    endpoint: str = request.getfixturevalue("s3_endpoint")
    bucket = new_bucket(endpoint)
    return BlobSetting(
        "s3",
        {
            "blob_url": f"s3://{bucket}/registry",
            "s3_endpoint_url": endpoint,
            "s3_region": "us-east-1",
            "s3_path_style": True,
        },
    )


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_model(tmp_path_factory.mktemp("base") / BASE)


@dataclass
class Served:
    """A registry in this process behind a real gRPC server on 127.0.0.1."""

    app: RegistryApp
    server: GrpcServer
    settings: RegistrySettings

    @property
    def address(self) -> str:
        return self.server.address

    def client(self, token: str | None = None) -> RegistryClient:
        return RegistryClient(self.address, token=token, timeout=30)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)


def registry_settings(tmp_path: Path, **overrides: Any) -> RegistrySettings:
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "data_dir": tmp_path / "data",
        "metrics_listen": "",
        "auth": "off",
        "watch_poll_seconds": 0.1,
        "drain_seconds": 2,
    }
    values.update(overrides)
    return RegistrySettings(**values)


def serve_registry(settings: RegistrySettings) -> Served:
    app = open_registry(settings)
    server = create_server(app, settings)
    server.start()
    server.set_serving(True)
    return Served(app, server, settings)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """``serve(**settings)`` starts an in-process registry; all stop at teardown."""
    started: list[Served] = []

    def start(**overrides: Any) -> Served:
        served = serve_registry(registry_settings(tmp_path, **overrides))
        started.append(served)
        return served

    yield start
    for served in started:
        served.server.drain()
        served.app.close()


def register_base(client: RegistryClient, folder: Path, name: str = BASE) -> None:
    client.register_base_model(read_model_spec(folder).to_proto(name))


@dataclass
class RegistryProcess:
    """``moelora-registry`` started from its console script."""

    process: Any  # tests.conftest.ServerProcess
    address: str


def launch_registry(start_server: Any, data_dir: Path, *flags: str) -> RegistryProcess:
    """Starts a registry subprocess on a free port and waits until it serves."""
    address = f"127.0.0.1:{free_port()}"
    process = start_server(
        "moelora-registry",
        "--listen",
        address,
        "--data-dir",
        str(data_dir),
        "--metrics-listen",
        "",
        "--drain-seconds",
        "2",
        *flags,
    )
    with grpc.insecure_channel(address) as channel:
        try:
            wait_until_serving(channel, SERVICE_NAME, timeout=60)
        except TimeoutError:
            raise AssertionError(f"registry did not start:\n{process.log()}") from None
    return RegistryProcess(process, address)


def adapterctl(
    address: str, *args: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "adapterctl"), "--address", address, *args]
    env = {**os.environ, **({"MOELORA_REGISTRY_TOKEN": token} if token else {})}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
