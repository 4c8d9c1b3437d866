"""Both blob stores behind the BlobStore interface: the local directory and S3
(moto's server over HTTP): atomic content-addressed writes, reads, listing,
deletes, presigned URLs, multipart uploads and cleanup of unfinished writes."""

from __future__ import annotations

import hashlib
import os
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest

from moelora.client.errors import FailedPrecondition
from registry_service.blobs import BlobStore, blob_key, open_blob_store
from registry_service.blobs.local import LocalBlobStore
from registry_service.blobs.s3 import S3BlobStore
from tests.registry.conftest import new_bucket

MIB = 1024 * 1024


def _file(tmp_path: Path, size: int, name: str = "payload") -> tuple[Path, str]:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path, blob_key(hashlib.sha256(path.read_bytes()).hexdigest())


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    endpoint: str = request.getfixturevalue("s3_endpoint")
    return S3BlobStore(
        new_bucket(endpoint),
        "prefix/",
        endpoint_url=endpoint,
        region="us-east-1",
        path_style=True,
        part_bytes=5 * MIB,  # S3's smallest part: 12 MiB goes up in three parts
    )


def test_put_read_list_delete(store: BlobStore, tmp_path: Path) -> None:
    small, small_key = _file(tmp_path, 1000, "small")
    big, big_key = _file(tmp_path, 12 * MIB, "big")
    assert not store.exists(small_key)
    store.put_file(small_key, small)
    store.put_file(big_key, big)
    store.put_file(big_key, big)  # same key, same size: nothing to do
    assert store.exists(small_key) and store.exists(big_key)
    listed = {b.key: b.size_bytes for b in store.list_blobs()}
    assert listed == {small_key: 1000, big_key: 12 * MIB}
    with store.open_range(big_key, 0, 12 * MIB) as reader:
        assert reader.read(12 * MIB) == big.read_bytes()
    with store.open_range(big_key, 5 * MIB + 3, 1000) as reader:
        assert reader.read(1000) == big.read_bytes()[5 * MIB + 3 : 5 * MIB + 1003]
    store.delete(big_key)
    store.delete(big_key)  # absent is fine
    assert not store.exists(big_key)
    with pytest.raises(FileNotFoundError), store.open_range(big_key, 0, 1):
        pass
    with pytest.raises(ValueError):
        store.exists("../etc/passwd")


def test_presigned_urls(store: BlobStore, tmp_path: Path) -> None:
    path, key = _file(tmp_path, 5000)
    store.put_file(key, path)
    if isinstance(store, LocalBlobStore):
        with pytest.raises(FailedPrecondition):
            store.presign_get(key, 60)
        return
    with urllib.request.urlopen(store.presign_get(key, 60), timeout=10) as response:
        assert response.read() == path.read_bytes()


def test_unfinished_writes_are_removed(store: BlobStore, tmp_path: Path) -> None:
    later = datetime.now(UTC) + timedelta(seconds=5)
    if isinstance(store, S3BlobStore):
        key = f"prefix/{blob_key('0' * 64)}"
        store._client.create_multipart_upload(Bucket=store.bucket, Key=key)
    else:
        assert isinstance(store, LocalBlobStore)
        (store.root / ".tmp" / "leftover").write_bytes(b"x")
        # Younger than the cutoff: kept. (moto dates every multipart upload 2010,
        # so this half runs on the local store only.)
        earlier = datetime.now(UTC) - timedelta(hours=1)
        assert store.remove_stale_temporaries(earlier, dry_run=False) == 0
    assert store.remove_stale_temporaries(later, dry_run=True) == 1
    assert store.remove_stale_temporaries(later, dry_run=False) == 1
    assert store.remove_stale_temporaries(later, dry_run=False) == 0


def test_blob_url_parsing(tmp_path: Path, s3_endpoint: str) -> None:
    assert isinstance(open_blob_store(None, tmp_path), LocalBlobStore)
    local = open_blob_store(f"file://{tmp_path / 'b'}", tmp_path)
    assert isinstance(local, LocalBlobStore) and local.root == tmp_path / "b"
    with pytest.raises(ValueError, match="three slashes"):
        open_blob_store("file://relative/path", tmp_path)
    with pytest.raises(ValueError, match="unsupported scheme"):
        open_blob_store("gs://bucket", tmp_path)
    with pytest.raises(OSError, match="cannot reach the bucket"):
        open_blob_store("s3://no-such-bucket", tmp_path, s3_endpoint_url=s3_endpoint)
    bucket = new_bucket(s3_endpoint)
    s3 = open_blob_store(f"s3://{bucket}", tmp_path, s3_endpoint_url=s3_endpoint)
    assert isinstance(s3, S3BlobStore) and s3.prefix == ""
    boto3.client("s3", endpoint_url=s3_endpoint).head_bucket(Bucket=bucket)
