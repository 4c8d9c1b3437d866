"""Where adapter bytes are stored: a content-addressed blob store with a local
directory backend and an S3 backend."""

from registry_service.blobs.base import BlobStat, BlobStore, blob_key
from registry_service.blobs.open import open_blob_store

__all__ = ["BlobStat", "BlobStore", "blob_key", "open_blob_store"]
