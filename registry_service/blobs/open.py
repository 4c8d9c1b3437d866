"""Where the blob URL setting becomes a store."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from registry_service.blobs.base import BlobStore
from registry_service.blobs.local import LocalBlobStore
from registry_service.blobs.s3 import DEFAULT_PART_BYTES, S3BlobStore


def open_blob_store(
    blob_url: str | None,
    data_dir: Path,
    *,
    s3_endpoint_url: str | None = None,
    s3_region: str | None = None,
    s3_path_style: bool = False,
    s3_part_bytes: int = DEFAULT_PART_BYTES,
    s3_max_attempts: int = 8,
    s3_timeout_seconds: float = 120.0,
) -> BlobStore:
    """``None`` -> ``data_dir/blobs``; ``file:///PATH`` or a plain path -> a local
    directory; ``s3://BUCKET[/PREFIX]`` -> S3 (the bucket must exist)."""
    if blob_url is None:
        return LocalBlobStore(data_dir / "blobs")
    parsed = urlparse(blob_url)
    if parsed.scheme in ("", "file"):
        if parsed.netloc:
            raise ValueError(f"blob_url: {blob_url!r}: use file:///ABSOLUTE/PATH (three slashes)")
        return LocalBlobStore(Path(parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"blob_url: {blob_url!r} names no bucket: use s3://BUCKET[/PREFIX]")
        store = S3BlobStore(
            parsed.netloc,
            parsed.path,
            endpoint_url=s3_endpoint_url,
            region=s3_region,
            path_style=s3_path_style,
            part_bytes=s3_part_bytes,
            max_attempts=s3_max_attempts,
            timeout_seconds=s3_timeout_seconds,
        )
        store.check_bucket()
        return store
    raise ValueError(f"blob_url: unsupported scheme {parsed.scheme!r}; use file:// or s3://")
