"""Where blobs live in the embedded mode: files under one directory.

An object is written to ``.tmp/`` and renamed into place, so a reader never
sees a partial file; a crash leaves at most a temporary that gc removes.
When the source is on the same file system it is hard-linked instead of copied.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from moelora.client.errors import FailedPrecondition
from registry_service.blobs.base import KEY_PREFIX, BlobStat, is_blob_key

_TMP = ".tmp"


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        (self.root / KEY_PREFIX).mkdir(parents=True, exist_ok=True)
        (self.root / _TMP).mkdir(exist_ok=True)

    @property
    def location(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        if not is_blob_key(key):
            raise ValueError(f"not a blob key: {key!r}")
        return self.root / key

    def put_file(self, key: str, source: Path) -> None:
        final = self._path(key)
        if final.exists() and final.stat().st_size == source.stat().st_size:
            return
        tmp = self.root / _TMP / f"{uuid.uuid4().hex}"
        try:
            try:
                os.link(source, tmp)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                shutil.copyfile(source, tmp)
                _fsync(tmp)
            tmp.chmod(0o444)
            tmp.replace(final)
        finally:
            tmp.unlink(missing_ok=True)
        # The rename is durable only once the directory entry is on disk.
        _fsync(final.parent)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def open_file(self, key: str) -> BinaryIO:
        """The object's file, unbuffered, for the caller to read and close (the blob HTTP
        server sends it with sendfile). Raises FileNotFoundError when the key is absent."""
        try:
            return self._path(key).open("rb", buffering=0)
        except FileNotFoundError:
            raise FileNotFoundError(f"blob {key} is missing from {self.location}") from None

    @contextmanager
    def open_range(self, key: str, offset: int, length: int) -> Iterator[BinaryIO]:
        with self.open_file(key) as handle:
            handle.seek(offset)
            yield handle

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_blobs(self) -> Iterator[BlobStat]:
        for entry in os.scandir(self.root / KEY_PREFIX):
            key = KEY_PREFIX + entry.name
            if entry.is_file() and is_blob_key(key):
                st = entry.stat()
                yield BlobStat(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def presign_get(self, key: str, expires_in_seconds: int) -> str:
        raise FailedPrecondition(
            "the local-directory blob store has no URLs: the registry's blob HTTP server is "
            "off (--http-listen); use DownloadAdapter (adapterctl download without --presigned)"
        )

    def remove_stale_temporaries(self, older_than: datetime, dry_run: bool) -> int:
        removed = 0
        for entry in os.scandir(self.root / _TMP):
            if datetime.fromtimestamp(entry.stat().st_mtime, UTC) < older_than:
                removed += 1
                if not dry_run:
                    Path(entry.path).unlink(missing_ok=True)
        return removed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
