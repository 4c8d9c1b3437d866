"""Where gRPC messages and the registry's plain data are translated."""

from __future__ import annotations

from datetime import datetime

from google.protobuf.timestamp_pb2 import Timestamp

from moelora.v1 import registry_pb2
from registry_service.domain import (
    ByteRange,
    Chunk,
    DeclaredFile,
    Event,
    EventType,
    FileInfo,
    ListFilter,
    UploadHeader,
    VersionInfo,
    VersionStatus,
)
from registry_service.service import PresignedVersion

_STATUS = {
    VersionStatus.PENDING: registry_pb2.ADAPTER_STATUS_PENDING,
    VersionStatus.READY: registry_pb2.ADAPTER_STATUS_READY,
    VersionStatus.FAILED: registry_pb2.ADAPTER_STATUS_FAILED,
    VersionStatus.DELETED: registry_pb2.ADAPTER_STATUS_DELETED,
}
_FORMAT = {
    "peft_3d": registry_pb2.ADAPTER_FORMAT_PEFT_3D,
    "peft_2d": registry_pb2.ADAPTER_FORMAT_PEFT_2D,
}
_EVENT = {
    EventType.READY: registry_pb2.ADAPTER_EVENT_TYPE_READY,
    EventType.DELETED: registry_pb2.ADAPTER_EVENT_TYPE_DELETED,
    EventType.ALIAS_SET: registry_pb2.ADAPTER_EVENT_TYPE_ALIAS_SET,
    EventType.ALIAS_DELETED: registry_pb2.ADAPTER_EVENT_TYPE_ALIAS_DELETED,
}


def timestamp(when: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(when)
    return stamp


def file_to_proto(f: FileInfo, *, parts: bool = True) -> registry_pb2.AdapterFile:
    """``parts``: with the per-piece sha256s (about 5 KB for a 1.26 GB file at 16 MiB)."""
    message = registry_pb2.AdapterFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256)
    if parts:
        message.part_size_bytes = f.part_size_bytes
        message.part_sha256.extend(f.part_sha256)
    return message


def version_to_proto(v: VersionInfo, *, parts: bool = True) -> registry_pb2.AdapterVersion:
    """``parts``: files with their per-piece sha256s; lists leave them out, so that a page of
    versions stays small (the proto says so)."""
    message = registry_pb2.AdapterVersion(
        name=v.name,
        version=v.version,
        digest=v.digest,
        base_model=v.base_model,
        base_model_fingerprint=v.base_model_fingerprint,
        status=_STATUS[v.status],
        format=_FORMAT.get(v.summary.format, registry_pb2.ADAPTER_FORMAT_UNSPECIFIED),
        rank=v.summary.rank,
        lora_alpha=v.summary.lora_alpha,
        use_rslora=v.summary.use_rslora,
        target_parameters=list(v.summary.target_parameters),
        layers=list(v.summary.layers),
        dtype=v.summary.dtype,
        size_bytes=v.size_bytes,
        files=[file_to_proto(f, parts=parts) for f in v.files],
        aliases=list(v.aliases),
        description=v.description,
        labels=dict(v.labels),
        create_time=timestamp(v.create_time),
        created_by=v.created_by,
    )
    if v.delete_time is not None:
        message.delete_time.CopyFrom(timestamp(v.delete_time))
    return message


def header_from_proto(h: registry_pb2.UploadHeader) -> UploadHeader:
    return UploadHeader(
        name=h.name,
        base_model=h.base_model,
        description=h.description,
        labels=dict(h.labels),
        alias=h.alias or None,
        files=[
            DeclaredFile(
                f.path, f.size_bytes, f.sha256 or None, f.part_size_bytes, tuple(f.part_sha256)
            )
            for f in h.files
        ],
    )


def chunk_from_proto(c: registry_pb2.FileChunk) -> Chunk:
    return Chunk(c.file_index, c.offset, c.data)


def range_from_proto(r: registry_pb2.DownloadAdapterRequest) -> ByteRange | None:
    if not r.HasField("range"):
        return None
    return ByteRange(r.range.file_index, r.range.offset, r.range.length)


def chunk_to_proto(c: Chunk) -> registry_pb2.FileChunk:
    return registry_pb2.FileChunk(file_index=c.file_index, offset=c.offset, data=c.data)


def list_filter_from_proto(r: registry_pb2.ListAdaptersRequest) -> ListFilter:
    return ListFilter(
        name=r.name,
        base_model=r.base_model,
        labels=dict(r.labels),
        include_deleted=r.include_deleted,
        latest_only=r.latest_only,
    )


def event_to_proto(e: Event) -> registry_pb2.WatchAdaptersResponse:
    return registry_pb2.WatchAdaptersResponse(
        sequence=e.sequence,
        type=_EVENT[e.type],
        name=e.name,
        version=e.version,
        digest=e.digest,
        alias=e.alias,
        previous_version=e.previous_version,
        event_time=timestamp(e.time),
    )


def presigned_to_proto(p: PresignedVersion) -> registry_pb2.GetDownloadUrlsResponse:
    return registry_pb2.GetDownloadUrlsResponse(
        version=version_to_proto(p.version),
        files=[registry_pb2.PresignedFile(file=file_to_proto(f.file), url=f.url) for f in p.files],
        expire_time=timestamp(p.expire_time),
    )
