"""The one interface both blob backends implement.

Keys are ``sha256/<64 hex>``: the content decides the key, so writing a key
twice writes the same bytes and a reader can check what it got. A key becomes
visible only once its object is complete.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, Protocol

KEY_PREFIX = "sha256/"
_KEY = re.compile(r"sha256/[0-9a-f]{64}")


def blob_key(sha256_hex: str) -> str:
    key = KEY_PREFIX + sha256_hex
    if not _KEY.fullmatch(key):
        raise ValueError(f"not a lower-case hex sha256: {sha256_hex!r}")
    return key


def is_blob_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


@dataclass(frozen=True)
class BlobStat:
    """An object in the store as its listing shows it."""

    key: str
    size_bytes: int
    modified: datetime


class BlobStore(Protocol):
    """Content-addressed object storage."""

    @property
    def location(self) -> str:
        """Where the objects live, for logs (no secrets)."""
        ...

    def put_file(self, key: str, source: Path) -> None:
        """Stores ``source``'s bytes under ``key``; the object appears complete or
        not at all. Does nothing when an object of the same size is there."""
        ...

    def exists(self, key: str) -> bool: ...

    def open_range(self, key: str, offset: int, length: int) -> AbstractContextManager[BinaryIO]:
        """A reader of the object's bytes ``offset`` to ``offset + length`` (the caller
        reads ``length`` bytes; the range lies within the object). Raises
        FileNotFoundError when the key is absent."""
        ...

    def delete(self, key: str) -> None:
        """Removes the object; absent keys are fine."""
        ...

    def list_blobs(self) -> Iterator[BlobStat]:
        """Every ``sha256/`` object."""
        ...

    def presign_get(self, key: str, expires_in_seconds: int) -> str:
        """An HTTP GET URL for the object; FailedPrecondition if the backend
        cannot presign."""
        ...

    def remove_stale_temporaries(self, older_than: datetime, dry_run: bool) -> int:
        """Removes leftovers of writes that never completed (temporary files,
        unfinished multipart uploads) started before ``older_than``; returns how
        many."""
        ...
