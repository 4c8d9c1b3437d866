"""Where upload bytes are received: the header is checked, then every chunk is
checked for order and size, and spooled to a temporary file (hashed whole and by pieces on
the way by the writer's threads), so that validation and the blob write work on complete,
hashed files.

Nothing here touches the database or the blob store.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from moelora.client.adapter_files import ADAPTER_FILES
from moelora.client.background_writer import BackgroundWriter
from moelora.client.errors import InvalidArgument, ResourceExhausted
from registry_service.domain import Chunk, DeclaredFile, FileInfo, UploadHeader, UploadTrailer
from shared.refs import validate_alias, validate_name

MAX_CHUNK_BYTES = 4 * 1024 * 1024
MAX_DESCRIPTION_CHARS = 4096
MAX_LABELS = 64
MAX_LABEL_VALUE_CHARS = 256
#: adapter_config.json is a few hundred bytes; anything near this is not a config.
MAX_CONFIG_BYTES = 1024 * 1024

#: Spooled bytes flushed to disk while the upload streams, not all at its end.
_SYNC_EVERY = 64 * 1024 * 1024

_LABEL_KEY = re.compile(r"[A-Za-z0-9._/-]{1,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_header(header: UploadHeader, max_file_bytes: int) -> UploadHeader:
    """Returns the header if it is acceptable; raises naming the field otherwise."""
    validate_name(header.name, "header.name")
    validate_name(header.base_model, "header.base_model")
    if header.alias:
        validate_alias(header.alias, "header.alias")
    if len(header.description) > MAX_DESCRIPTION_CHARS:
        raise InvalidArgument(
            f"header.description: {len(header.description)} characters, at most "
            f"{MAX_DESCRIPTION_CHARS}",
            "header.description",
        )
    if "\0" in header.description:  # PostgreSQL's text cannot hold NUL
        raise InvalidArgument(
            "header.description: must not contain NUL characters", "header.description"
        )
    check_labels(header.labels, "header.labels")
    paths = [f.path for f in header.files]
    if sorted(paths) != sorted(ADAPTER_FILES):
        raise InvalidArgument(
            f"header.files: got {paths}, expected exactly {list(ADAPTER_FILES)} (in any order)",
            "header.files",
        )
    for i, f in enumerate(header.files):
        field = f"header.files[{i}]"
        if f.size_bytes <= 0:
            raise InvalidArgument(f"{field}: {f.path} has size_bytes 0", field)
        limit = MAX_CONFIG_BYTES if f.path == ADAPTER_FILES[0] else max_file_bytes
        if f.size_bytes > limit:
            raise ResourceExhausted(
                f"{field}: {f.path} is {f.size_bytes} bytes, larger than this server's limit "
                f"of {limit} bytes",
                field,
            )
        if f.sha256 is not None and not _SHA256_HEX.fullmatch(f.sha256):
            raise InvalidArgument(
                f"{field}: sha256 must be 64 lower-case hex digits or empty", field
            )
        for name, given in (
            ("part_size_bytes", f.part_size_bytes),
            ("part_sha256", f.part_sha256),
        ):
            if given:
                raise InvalidArgument(
                    f"{field}.{name}: must be left empty, the registry records the pieces",
                    f"{field}.{name}",
                )
    return header


def check_labels(labels: Mapping[str, str], field: str) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"{field}: {len(labels)} labels, at most {MAX_LABELS}", field)
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise InvalidArgument(
                f"{field}: key {key!r} must be 1-63 characters of A-Z a-z 0-9 . _ / -", field
            )
        if len(value) > MAX_LABEL_VALUE_CHARS or any(ord(c) < 0x20 for c in value):
            raise InvalidArgument(
                f"{field}[{key}]: values are at most {MAX_LABEL_VALUE_CHARS} printable characters",
                field,
            )


@dataclass(frozen=True)
class SpooledFile:
    info: FileInfo
    path: Path


class _Receiving:
    def __init__(self, declared: DeclaredFile, path: Path, head_limit: int, part_size: int) -> None:
        self.declared = declared
        self.path = path
        # Hashes what it writes (whole and by pieces), and flushes it to disk as it goes:
        # finish() fsyncs the tail.
        self.writer = BackgroundWriter(path, sync_every=_SYNC_EVERY, part_size=part_size)
        self.received = 0
        # The first bytes, kept in memory for the checks that run while the rest
        # is still on its way; None once those checks are done.
        self.head: bytearray | None = bytearray()
        self.head_limit = head_limit


class UploadSpool:
    """Temporary files for one upload's declared files; removed on close."""

    def __init__(
        self, spool_dir: Path, files: Sequence[DeclaredFile], head_bytes: int, part_size: int
    ) -> None:
        """``head_bytes``: how much of each file's start ``head`` can return; ``part_size``:
        the piece size of the per-piece sha256s every file gets."""
        spool_dir.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix="upload-", dir=spool_dir))
        # check_header allowed only the two fixed file names, so they are safe here.
        self._files = [_Receiving(f, self._dir / f.path, head_bytes, part_size) for f in files]
        self._by_path = {f.declared.path: f for f in self._files}
        self._current = 0
        self._trailer: UploadTrailer | None = None

    def head(self, path: str) -> tuple[bytes, bool] | None:
        """The first bytes of ``path`` received so far (at most ``head_bytes``) and
        whether that is the whole file; None after ``drop_heads``."""
        f = self._by_path[path]
        if f.head is None:
            return None
        return bytes(f.head), f.received == f.declared.size_bytes

    def drop_heads(self) -> None:
        for f in self._files:
            f.head = None

    def expect(self, trailer: UploadTrailer) -> None:
        """Takes the trailer's sha256 of every file, which ``finish`` checks; it must be the
        last message and agree with the header's sha256 where that was given."""
        if self._trailer is not None:
            raise InvalidArgument("trailer repeated: send it once, last", "trailer")
        if len(trailer.sha256) != len(self._files):
            raise InvalidArgument(
                f"trailer.sha256: {len(trailer.sha256)} values, the header declares "
                f"{len(self._files)} files",
                "trailer.sha256",
            )
        for f, sha256 in zip(self._files, trailer.sha256, strict=True):
            if not _SHA256_HEX.fullmatch(sha256):
                raise InvalidArgument(
                    f"trailer.sha256: {sha256!r} for {f.declared.path} is not 64 lower-case "
                    "hex digits",
                    "trailer.sha256",
                )
            if f.declared.sha256 is not None and f.declared.sha256 != sha256:
                raise InvalidArgument(
                    f"trailer.sha256: {f.declared.path} is {sha256} in the trailer but "
                    f"{f.declared.sha256} in the header",
                    "trailer.sha256",
                )
        self._trailer = trailer

    def write(self, chunk: Chunk) -> None:
        """Appends one chunk; chunks must come file by file, in order, without gaps."""
        if self._trailer is not None:
            raise InvalidArgument("chunk after the trailer: the trailer comes last", "chunk")
        while self._current < len(self._files) and self._complete(self._current):
            self._current += 1
        if chunk.file_index >= len(self._files):
            raise InvalidArgument(
                f"chunk.file_index {chunk.file_index}: the header declares "
                f"{len(self._files)} files",
                "chunk.file_index",
            )
        if self._current == len(self._files):
            raise InvalidArgument(
                "chunk after every declared byte arrived: check the header's size_bytes",
                "chunk",
            )
        if chunk.file_index != self._current:
            expected = self._files[self._current].declared.path
            raise InvalidArgument(
                f"chunk out of order: got file_index {chunk.file_index}, expected "
                f"{self._current} ({expected}) until it is complete",
                "chunk.file_index",
            )
        target = self._files[chunk.file_index]
        name = target.declared.path
        if chunk.offset != target.received:
            raise InvalidArgument(
                f"chunk out of order: {name} offset {chunk.offset}, expected {target.received}",
                "chunk.offset",
            )
        if not chunk.data or len(chunk.data) > MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk.data: {len(chunk.data)} bytes; chunks carry 1 to {MAX_CHUNK_BYTES}",
                "chunk.data",
            )
        if target.received + len(chunk.data) > target.declared.size_bytes:
            raise InvalidArgument(
                f"{name}: more bytes than the declared size_bytes {target.declared.size_bytes}",
                "chunk.data",
            )
        target.writer.write(chunk.data)
        if target.head is not None and len(target.head) < target.head_limit:
            target.head += chunk.data[: target.head_limit - len(target.head)]
        target.received += len(chunk.data)

    def _complete(self, index: int) -> bool:
        f = self._files[index]
        return f.received == f.declared.size_bytes

    def finish(self) -> list[SpooledFile]:
        """Checks that every file arrived whole with the declared sha256, makes
        the files durable and returns them."""
        done = []
        for index, f in enumerate(self._files):
            name = f.declared.path
            if f.received != f.declared.size_bytes:
                raise InvalidArgument(
                    f"{name}: upload ended after {f.received} of {f.declared.size_bytes} bytes",
                    "chunk",
                )
            # The local blob store may hard-link this file: make its bytes durable.
            digests = f.writer.close(sync=True)
            digest = digests.sha256
            if f.declared.sha256 is not None and f.declared.sha256 != digest:
                raise InvalidArgument(
                    f"{name}: sha256 of the bytes received is {digest}, the header says "
                    f"{f.declared.sha256}",
                    "header.files",
                )
            if self._trailer is not None and self._trailer.sha256[index] != digest:
                raise InvalidArgument(
                    f"{name}: sha256 of the bytes received is {digest}, the trailer says "
                    f"{self._trailer.sha256[index]}",
                    "trailer.sha256",
                )
            info = FileInfo(name, f.received, digest, digests.part_size_bytes, digests.part_sha256)
            done.append(SpooledFile(info, f.path))
        return done

    def close(self) -> None:
        for f in self._files:
            f.writer.discard()
        self._dir.rmdir()
