"""Where a version's bytes leave the registry (DownloadAdapter).

Each file is read by a thread of its own a few chunks ahead of the sender and hashed as it is
read, so that reading and hashing the next chunk overlap sending this one (the gRPC thread
waits for each message to go out). The stored bytes are read once: a file whose bytes do not
match its sha256 fails the stream with DATA_LOSS after its last chunk. The client checks every
file's sha256 as well, so a corrupt byte is never used either way. A byte range of one file (a
part of a parallel ranged download) is sent unhashed: part of a file cannot be checked against
the file's sha256; the client checks the whole file once every part arrived.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from registry_service import metrics
from registry_service.blobs import BlobStore
from registry_service.domain import ByteRange, Chunk, StoredFile, VersionInfo
from shared.errors import DataLoss, InvalidArgument

#: Chunks read ahead of the one being sent.
_READ_AHEAD = 4
#: How often a blocked reader thread checks whether the stream was abandoned.
_POLL_SECONDS = 0.1


def check_range(byte_range: ByteRange, files: Sequence[StoredFile]) -> ByteRange:
    """The range with its length resolved (0 meant: to the end of the file); InvalidArgument
    naming the field when it lies outside the version's files."""
    if byte_range.file_index >= len(files):
        raise InvalidArgument(
            f"range.file_index: {byte_range.file_index}, the version has {len(files)} files",
            "range.file_index",
        )
    size = files[byte_range.file_index].info.size_bytes
    if byte_range.offset > size:
        raise InvalidArgument(
            f"range.offset: {byte_range.offset} is beyond the file's {size} bytes", "range.offset"
        )
    length = byte_range.length or size - byte_range.offset
    if byte_range.offset + length > size:
        raise InvalidArgument(
            f"range.length: {byte_range.offset} + {length} is beyond the file's {size} bytes",
            "range.length",
        )
    return ByteRange(byte_range.file_index, byte_range.offset, length)


def stream_files(
    blobs: BlobStore,
    version: VersionInfo,
    files: Sequence[StoredFile],
    chunk_size: int,
    byte_range: ByteRange | None,
) -> Iterator[Chunk]:
    """The chunks of every file in order (each checked against its sha256 as it is read), or of
    ``byte_range`` alone (checked by ``check_range``, not hashed)."""
    if byte_range is not None:
        yield from _stream(blobs, version, files, byte_range, chunk_size, verify=False)
        return
    for index, stored in enumerate(files):
        whole = ByteRange(index, 0, stored.info.size_bytes)
        yield from _stream(blobs, version, files, whole, chunk_size, verify=True)


def _stream(
    blobs: BlobStore,
    version: VersionInfo,
    files: Sequence[StoredFile],
    byte_range: ByteRange,
    chunk_size: int,
    verify: bool,
) -> Iterator[Chunk]:
    stored = files[byte_range.file_index]
    where = f"{version.name}:{version.version} {stored.info.path}"
    hasher = hashlib.sha256() if verify else None
    try:
        with blobs.open_range(stored.blob_key, byte_range.offset, byte_range.length) as reader:
            ahead = _ReadAhead(reader, byte_range.length, chunk_size, hasher, where)
            try:
                offset = byte_range.offset
                for data in ahead:
                    yield Chunk(byte_range.file_index, offset, data)
                    offset += len(data)
                    metrics.DOWNLOAD_BYTES.inc(len(data))
            finally:
                ahead.close()
    except FileNotFoundError:
        raise DataLoss(f"{where}: blob {stored.blob_key} is missing from the blob store") from None
    if hasher is not None and hasher.hexdigest() != stored.info.sha256:
        metrics.DATA_LOSS.inc()
        raise DataLoss(
            f"{where}: stored bytes have sha256 {hasher.hexdigest()}, expected "
            f"{stored.info.sha256} (blob {stored.blob_key} is corrupt)"
        )


class _ReadAhead:
    """Reads ``length`` bytes from ``reader`` in a thread, hashing them into ``hasher``, at
    most ``_READ_AHEAD`` chunks ahead of the iterator."""

    def __init__(
        self,
        reader: BinaryIO,
        length: int,
        chunk_size: int,
        hasher: hashlib._Hash | None,
        where: str,
    ) -> None:
        self._reader = reader
        self._length = length
        self._chunk_size = chunk_size
        self._hasher = hasher
        self._where = where
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(_READ_AHEAD)
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blob-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            left = self._length
            while left and not self._abandoned.is_set():
                data = self._reader.read(min(self._chunk_size, left))
                if not data:
                    raise DataLoss(
                        f"{self._where}: the stored blob ends {left} bytes before its recorded "
                        "size (it is truncated)"
                    )
                if self._hasher is not None:
                    self._hasher.update(data)  # releases the GIL: overlaps the sender
                left -= len(data)
                self._put(data)
            self._put(None)
        except BaseException as exc:  # handed to the iterating thread
            self._put(exc)

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self._abandoned.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stops the thread (the stream ended or was abandoned) and waits for it."""
        self._abandoned.set()
        self._thread.join()
