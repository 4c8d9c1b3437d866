"""Where blobs live in production: an S3 bucket (AWS, MinIO, R2, Ceph) via boto3.

S3 makes an object visible only when its PUT (or CompleteMultipartUpload)
succeeds, so objects are written straight to their final key; a crash leaves
at most an unfinished multipart upload, which gc aborts. Big files go up as
parallel parts (TransferConfig) and are read as ranged GETs streamed straight
to the reader (DownloadAdapter sends them on as they arrive); every request retries with
exponential backoff (botocore's "standard" retry mode, ``max_attempts`` in all).
A store that stays unreachable, slow or failing past those attempts raises
``Unavailable`` (a status clients retry), never a bare botocore error. Credentials
come from the standard AWS chain (environment, profile, instance role).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from moelora.client.errors import Unavailable
from registry_service import metrics
from registry_service.blobs.base import KEY_PREFIX, BlobStat, is_blob_key

_MIB = 1024 * 1024
#: Files above this go up in parts of this size, 8 at a time.
DEFAULT_PART_BYTES = 64 * _MIB


@contextmanager
def _unavailable_on_failure(location: str) -> Iterator[None]:
    """S3 failures past botocore's retries as Unavailable: the store, not the request, is wrong."""
    try:
        yield
    except (BotoCoreError, ClientError, Boto3Error) as exc:
        metrics.BLOB_STORE_ERRORS.inc()
        raise Unavailable(f"blob store {location} failed: {exc}; retry later") from exc


class S3BlobStore:
    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        path_style: bool = False,
        max_attempts: int = 8,
        timeout_seconds: float = 120.0,
        part_bytes: int = DEFAULT_PART_BYTES,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._endpoint = endpoint_url
        self._transfer = TransferConfig(
            multipart_threshold=part_bytes,
            multipart_chunksize=part_bytes,
            max_concurrency=8,
            use_threads=True,
        )
        config = Config(
            region_name=region,
            signature_version="s3v4",
            retries={"mode": "standard", "max_attempts": max_attempts},
            s3={"addressing_style": "path" if path_style else "auto"},
            connect_timeout=min(10.0, timeout_seconds),
            read_timeout=timeout_seconds,
            max_pool_connections=32,
        )
        self._client: Any = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, config=config
        )

    @property
    def location(self) -> str:
        where = f" at {self._endpoint}" if self._endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def check_bucket(self) -> None:
        """Fails with a clear message when the bucket is missing or unreachable."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            raise OSError(f"blob store {self.location}: cannot reach the bucket: {exc}") from exc

    def _object(self, key: str) -> str:
        if not is_blob_key(key):
            raise ValueError(f"not a blob key: {key!r}")
        return self.prefix + key

    def _size(self, key: str) -> int | None:
        with _unavailable_on_failure(self.location):
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=self._object(key))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise
        return int(head["ContentLength"])

    def put_file(self, key: str, source: Path) -> None:
        if self._size(key) == source.stat().st_size:
            return
        with _unavailable_on_failure(self.location):
            self._client.upload_file(
                str(source), self.bucket, self._object(key), Config=self._transfer
            )

    def exists(self, key: str) -> bool:
        return self._size(key) is not None

    @contextmanager
    def open_range(self, key: str, offset: int, length: int) -> Iterator[BinaryIO]:
        if length == 0:
            if not self.exists(key):
                raise FileNotFoundError(f"blob {key} is missing from {self.location}")
            yield io.BytesIO()
            return
        with _unavailable_on_failure(self.location):
            try:
                response = self._client.get_object(
                    Bucket=self.bucket,
                    Key=self._object(key),
                    Range=f"bytes={offset}-{offset + length - 1}",
                )
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    raise FileNotFoundError(f"blob {key} is missing from {self.location}") from None
                raise
            body = response["Body"]
            try:
                yield body
            finally:
                body.close()

    def delete(self, key: str) -> None:
        with _unavailable_on_failure(self.location):
            self._client.delete_object(Bucket=self.bucket, Key=self._object(key))

    def list_blobs(self) -> Iterator[BlobStat]:
        with _unavailable_on_failure(self.location):
            yield from self._list_blobs()

    def _list_blobs(self) -> Iterator[BlobStat]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + KEY_PREFIX
        )
        for page in pages:
            for item in page.get("Contents", []):
                key = item["Key"][len(self.prefix) :]
                if is_blob_key(key):
                    yield BlobStat(key, int(item["Size"]), item["LastModified"])

    def presign_get(self, key: str, expires_in_seconds: int) -> str:
        url: str = self._client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self._object(key)},
            ExpiresIn=expires_in_seconds,
        )
        return url

    def remove_stale_temporaries(self, older_than: datetime, dry_run: bool) -> int:
        with _unavailable_on_failure(self.location):
            return self._abort_stale_uploads(older_than, dry_run)

    def _abort_stale_uploads(self, older_than: datetime, dry_run: bool) -> int:
        removed = 0
        pages = self._client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix + KEY_PREFIX
        )
        for page in pages:
            for upload in page.get("Uploads", []):
                if upload["Initiated"] < older_than:
                    removed += 1
                    if not dry_run:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
        return removed
