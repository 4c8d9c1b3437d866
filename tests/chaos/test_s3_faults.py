"""The registry's S3 store fails under it: refused connections, transfers reset in the middle,
500 errors, a slow link. Each upload or download then either completes intact or answers
UNAVAILABLE (after --s3-max-attempts) with nothing half-visible: no version, no object beyond
those of READY versions; once S3 is back the same calls succeed without an operator, and what
comes down has the sha256 that went up."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import boto3
import grpc
import pytest

from moelora.client.errors import MoeLoraError
from tests.chaos.fault_proxy import FaultProxy, Mode
from tests.registry.conftest import (
    BASE,
    Served,
    new_bucket,
    register_base,
    registry_settings,
    serve_registry,
)
from tests.registry.fixtures import write_adapter

LONG = pytest.mark.long
#: The first fault of each list runs in ``make test``; all with --long.
UPLOAD_FAULTS = ["refuse", pytest.param("reset", marks=LONG), pytest.param("http500", marks=LONG)]
DOWNLOAD_FAULTS = ["reset", pytest.param("refuse", marks=LONG), pytest.param("http500", marks=LONG)]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def s3(s3_endpoint: str) -> Iterator[tuple[FaultProxy, str]]:
    """The proxy in front of moto, and a fresh bucket."""
    bucket = new_bucket(s3_endpoint)
    with FaultProxy(s3_endpoint.removeprefix("http://")) as proxy:
        yield proxy, bucket


@pytest.fixture
def registry(s3: tuple[FaultProxy, str], tmp_path: Path, base_model_dir: Path) -> Iterator[Served]:
    proxy, bucket = s3
    settings = registry_settings(
        tmp_path,
        blob_url=f"s3://{bucket}/chaos",
        s3_endpoint_url=f"http://{proxy.address}",
        s3_region="us-east-1",
        s3_path_style=True,
        s3_max_attempts=2,
        s3_timeout_seconds=2,
        gc_interval_seconds=0,
    )
    served = serve_registry(settings)
    with served.client() as client:
        register_base(client, base_model_dir)
    yield served
    served.server.drain()
    served.app.close()


def _objects(s3_endpoint: str, bucket: str) -> set[str]:
    listing = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket)
    return {item["Key"] for item in listing.get("Contents", [])}


def _sha256(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fault", UPLOAD_FAULTS)
def test_upload_during_an_s3_fault(
    fault: Mode,
    registry: Served,
    s3: tuple[FaultProxy, str],
    s3_endpoint: str,
    tmp_path: Path,
    repeats: int,
) -> None:
    proxy, bucket = s3
    proxy.reset_after = 1024
    adapter = write_adapter(tmp_path / "adapter")
    ready_objects: set[str] = set()  # the objects of READY versions
    with registry.client() as client:
        for attempt in range(repeats):
            name = f"a{attempt}"
            proxy.mode = fault
            with pytest.raises(MoeLoraError) as info:
                client.upload(adapter, name, BASE)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value.message
            proxy.mode = "pass"
            assert [v.name for v in client.list_versions(name=name, include_deleted=True)] == []
            assert _objects(s3_endpoint, bucket) == ready_objects
            # S3 back: the same upload goes through, and comes down intact.
            version = client.upload(adapter, name, BASE)
            client.download(f"{name}:{version.version}", tmp_path / f"down{attempt}")
            assert _sha256(tmp_path / f"down{attempt}") == _sha256(adapter)
            # Content-addressed: every version of the same files shares their two objects.
            ready_objects = _objects(s3_endpoint, bucket)
            assert len(ready_objects) == 2


@pytest.mark.parametrize("fault", DOWNLOAD_FAULTS)
def test_download_during_an_s3_fault(
    fault: Mode, registry: Served, s3: tuple[FaultProxy, str], tmp_path: Path, repeats: int
) -> None:
    proxy, _ = s3
    proxy.reset_after = 1024
    adapter = write_adapter(tmp_path / "adapter")
    with registry.client() as client:
        client.upload(adapter, "a", BASE)
        for attempt in range(repeats):
            out = tmp_path / f"out{attempt}"
            proxy.mode = fault
            with pytest.raises(MoeLoraError) as info:
                client.download("a:1", out)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value.message
            assert not out.exists() or list(out.iterdir()) == []  # nothing half-written
            proxy.mode = "pass"
            client.download("a:1", out)
            assert _sha256(out) == _sha256(adapter)


def test_slow_s3_completes_intact(
    registry: Served, s3: tuple[FaultProxy, str], tmp_path: Path
) -> None:
    proxy, _ = s3
    proxy.mode, proxy.delay, proxy.chunk = "slow", 0.02, 4096
    adapter = write_adapter(tmp_path / "adapter")
    with registry.client() as client:
        client.upload(adapter, "slow", BASE)
        client.download("slow:1", tmp_path / "out")
    assert _sha256(tmp_path / "out") == _sha256(adapter)
