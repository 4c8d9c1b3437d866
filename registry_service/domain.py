"""The registry's plain data: what the service takes and returns. The gRPC layer
translates these to and from messages (messages.py); nothing here knows gRPC."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

T = TypeVar("T")


class VersionStatus(enum.StrEnum):
    PENDING = "PENDING"
    READY = "READY"
    FAILED = "FAILED"
    DELETED = "DELETED"


class EventType(enum.StrEnum):
    READY = "READY"
    DELETED = "DELETED"
    ALIAS_SET = "ALIAS_SET"
    ALIAS_DELETED = "ALIAS_DELETED"


@dataclass(frozen=True)
class FileInfo:
    """A stored file. ``part_sha256``: the sha256 of each ``part_size_bytes`` piece, in order
    (see moelora/client/part_digests.py); 0 and () for versions uploaded before pieces were
    recorded."""

    path: str
    size_bytes: int
    sha256: str
    part_size_bytes: int
    part_sha256: tuple[str, ...]


@dataclass(frozen=True)
class DeclaredFile:
    """A file as the upload header announces it; ``sha256`` is optional there. The pieces
    are kept only so that check_header can refuse them: the registry records its own."""

    path: str
    size_bytes: int
    sha256: str | None
    part_size_bytes: int = 0
    part_sha256: tuple[str, ...] = ()


@dataclass(frozen=True)
class UploadHeader:
    name: str
    base_model: str
    description: str
    labels: Mapping[str, str]
    alias: str | None
    files: Sequence[DeclaredFile]


@dataclass(frozen=True)
class Chunk:
    file_index: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class UploadTrailer:
    """Every file's sha256 (lower-case hex), in the header's order, sent after the bytes."""

    sha256: tuple[str, ...]


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``offset`` to ``offset + length`` of one file of a version (0: to its end)."""

    file_index: int
    offset: int
    length: int


@dataclass(frozen=True)
class AdapterSummary:
    """What validation learned about an adapter's weights."""

    format: str  # "peft_3d" or "peft_2d"
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_parameters: tuple[str, ...]
    layers: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class VersionInfo:
    """One adapter version as callers see it."""

    name: str
    version: int
    digest: str
    base_model: str
    base_model_fingerprint: str
    status: VersionStatus
    summary: AdapterSummary
    size_bytes: int
    files: tuple[FileInfo, ...]
    aliases: tuple[str, ...]
    description: str
    labels: Mapping[str, str]
    create_time: datetime
    created_by: str
    delete_time: datetime | None


@dataclass(frozen=True)
class StoredFile:
    """A version's file together with where its bytes are."""

    info: FileInfo
    blob_key: str


@dataclass(frozen=True)
class ListFilter:
    name: str = ""
    base_model: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    include_deleted: bool = False
    latest_only: bool = False


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next_token: str


@dataclass(frozen=True)
class Event:
    sequence: int
    type: EventType
    name: str
    version: int
    digest: str
    alias: str
    previous_version: int
    time: datetime
    base_model: str = ""

    def matches(self, name: str, base_model: str) -> bool:
        """Whether a watch filtered by ``name`` and ``base_model`` (empty: any) sees it."""
        return (not name or self.name == name) and (not base_model or self.base_model == base_model)


@dataclass(frozen=True)
class AliasChange:
    version: VersionInfo
    previous_version: int


@dataclass(frozen=True)
class GcReport:
    removed_blobs: list[str]
    removed_bytes: int
    purged_versions: int
