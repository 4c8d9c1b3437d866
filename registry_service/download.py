"""Where a version's bytes leave the registry (DownloadAdapter).

Each file is read by a thread of its own a few chunks ahead of the sender and hashed as it is read
(``moelora.client.read_ahead``), so that reading and hashing the next chunk overlap sending this one
(the gRPC thread waits for each message to go out). The stored bytes are read once: a file whose
bytes do not match its sha256 fails the stream with DATA_LOSS after its last chunk. The client
checks every file's sha256 as well, so a corrupt byte is never used either way. A byte range of one
file (a part of a parallel ranged download) is sent unhashed: part of a file cannot be checked
against the file's sha256; the client checks the whole file once every part arrived.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from moelora.client.errors import DataLoss, InvalidArgument
from moelora.client.read_ahead import ReadAhead
from registry_service import metrics
from registry_service.blobs import BlobStore
from registry_service.domain import ByteRange, Chunk, StoredFile, VersionInfo


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
            blob = f"{where}: the stored blob"
            with ReadAhead(reader, byte_range.length, chunk_size, hasher, blob) as ahead:
                offset = byte_range.offset
                for data in ahead:
                    yield Chunk(byte_range.file_index, offset, data)
                    offset += len(data)
                    metrics.DOWNLOAD_BYTES.inc(len(data))
    except FileNotFoundError:
        raise DataLoss(f"{where}: blob {stored.blob_key} is missing from the blob store") from None
    if hasher is not None and hasher.hexdigest() != stored.info.sha256:
        metrics.DATA_LOSS.inc()
        raise DataLoss(
            f"{where}: stored bytes have sha256 {hasher.hexdigest()}, expected "
            f"{stored.info.sha256} (blob {stored.blob_key} is corrupt)"
        )
