"""A typed client of the AdapterRegistry API: what adapterctl and the executor call.

Every call has a deadline except the streams, which move gigabytes; errors come
back as moelora.client.errors classes. Uploads hash each file as they send it and send the
sha256s in a trailer, so the server checks end to end what it received; downloads
verify every file before it is renamed into place.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from moelora.client import keepalive
from moelora.client.adapter_files import ADAPTER_FILES
from moelora.client.auth import open_channel
from moelora.client.background_writer import BackgroundWriter
from moelora.client.errors import DataLoss, InvalidArgument, from_rpc_error
from moelora.client.read_ahead import ReadAhead
from moelora.client.rpc_metadata import WATCH_START_METADATA
from moelora.v1 import model_pb2, registry_pb2, registry_pb2_grpc

#: Upload and download chunks. Measured with grpcio over 127.0.0.1, 512 KiB-1 MiB messages
#: stream 2-3x faster than 4 MiB ones (large messages are reassembled and copied again).
CHUNK_BYTES = 1024 * 1024
#: gRPC messages up to this size; chunks are at most 4 MiB (the registry's limit), versions a
#: few KiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: Reads that meet a connection just lost (UNAVAILABLE) are tried again by gRPC itself: a
#: stream only before its first message arrived, so nothing is received twice.
_RETRY_READS = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "moelora.v1.AdapterRegistry", "method": method}
                    for method in (
                        "GetBaseModel",
                        "ListBaseModels",
                        "GetAdapter",
                        "ListAdapters",
                        "DownloadAdapter",
                        "GetDownloadUrls",
                    )
                ],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

T = TypeVar("T")
Progress = Callable[[int], None]


def _no_progress(_n: int) -> None:
    pass


@dataclass(frozen=True)
class LocalFile:
    path: Path
    size_bytes: int


def describe_folder(folder: Path) -> list[LocalFile]:
    """The adapter's two files with their sizes, in upload order."""
    files = []
    for name in ADAPTER_FILES:
        path = folder / name
        if not path.is_file():
            raise InvalidArgument(f"{folder}: no {name} (an adapter folder holds {ADAPTER_FILES})")
        files.append(LocalFile(path, path.stat().st_size))
    return files


class RegistryClient:
    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout: float = 30.0,
        connections: int = 1,
        keepalive_seconds: float = keepalive.DEFAULT_KEEPALIVE_SECONDS,
    ) -> None:
        """``connections``: TCP connections that ranged reads (``read_range``) spread over;
        one HTTP/2 connection is served by one thread at each end, so parallel ranged reads
        need connections of their own to run in parallel. ``keepalive_seconds``: while a
        call is open, a connection silent this long is pinged, and closed when the ping is not
        answered within as long again (``moelora/client/keepalive.py``): a connection that died
        without a word cannot hold a download or the watch stream forever."""
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.service_config", _RETRY_READS),
            *keepalive.client_options(keepalive_seconds),
        ]
        self._channels = [
            open_channel(
                address,
                token=token,
                tls=tls,
                root_certificates=root_certificates,
                # Without a subchannel pool of its own, a channel shares the first one's
                # connection.
                options=options + ([("grpc.use_local_subchannel_pool", 1)] if n else []),
            )
            for n in range(max(1, connections))
        ]
        self._stubs = [registry_pb2_grpc.AdapterRegistryStub(c) for c in self._channels]
        self._stub = self._stubs[0]
        self._next_stub = itertools.count()
        self.timeout = timeout

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, method: Callable[..., Any], request: Any, response_type: type[T], **kwargs: Any
    ) -> T:
        try:
            response = method(request, timeout=kwargs.pop("timeout", self.timeout), **kwargs)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        assert isinstance(response, response_type)
        return response

    # -- base models ---------------------------------------------------------------------------

    def register_base_model(
        self, base_model: model_pb2.BaseModel
    ) -> registry_pb2.RegisterBaseModelResponse:
        return self._call(
            self._stub.RegisterBaseModel,
            registry_pb2.RegisterBaseModelRequest(base_model=base_model),
            registry_pb2.RegisterBaseModelResponse,
        )

    def get_base_model(self, name: str) -> model_pb2.BaseModel:
        request = registry_pb2.GetBaseModelRequest(name=name)
        return self._call(
            self._stub.GetBaseModel, request, registry_pb2.GetBaseModelResponse
        ).base_model

    def list_base_models(self) -> Iterator[model_pb2.BaseModel]:
        token = ""
        while True:
            page = self._call(
                self._stub.ListBaseModels,
                registry_pb2.ListBaseModelsRequest(page_token=token),
                registry_pb2.ListBaseModelsResponse,
            )
            yield from page.base_models
            token = page.next_page_token
            if not token:
                return

    # -- adapters ------------------------------------------------------------------------------

    def upload(
        self,
        folder: Path,
        name: str,
        base_model: str,
        *,
        alias: str = "",
        description: str = "",
        labels: dict[str, str] | None = None,
        progress: Progress = _no_progress,
        timeout: float | None = None,
    ) -> registry_pb2.AdapterVersion:
        files = describe_folder(folder)
        header = registry_pb2.UploadHeader(
            name=name,
            base_model=base_model,
            description=description,
            labels=labels or {},
            alias=alias,
            files=[
                registry_pb2.AdapterFile(path=f.path.name, size_bytes=f.size_bytes) for f in files
            ],
        )

        def requests() -> Iterator[registry_pb2.UploadAdapterRequest]:
            yield registry_pb2.UploadAdapterRequest(header=header)
            digests = []
            for index, f in enumerate(files):
                # Hashed as it is read, ahead of the sender: the trailer carries the sha256s,
                # so the files are read once.
                digest = hashlib.sha256()
                with (
                    f.path.open("rb", buffering=0) as handle,
                    ReadAhead(handle, f.size_bytes, CHUNK_BYTES, digest, str(f.path)) as chunks,
                ):
                    offset = 0
                    for data in chunks:
                        yield registry_pb2.UploadAdapterRequest(
                            chunk=registry_pb2.FileChunk(file_index=index, offset=offset, data=data)
                        )
                        offset += len(data)
                        progress(len(data))
                digests.append(digest.hexdigest())
            yield registry_pb2.UploadAdapterRequest(
                trailer=registry_pb2.UploadTrailer(sha256=digests)
            )

        response = self._call(
            self._stub.UploadAdapter,
            requests(),
            registry_pb2.UploadAdapterResponse,
            timeout=timeout,
        )
        return response.version

    def get(self, ref: str, *, timeout: float | None = None) -> registry_pb2.AdapterVersion:
        """``timeout``: this call's deadline (default: the client's)."""
        return self._call(
            self._stub.GetAdapter,
            registry_pb2.GetAdapterRequest(ref=ref),
            registry_pb2.GetAdapterResponse,
            timeout=timeout or self.timeout,
        ).version

    def list_versions(
        self,
        *,
        name: str = "",
        base_model: str = "",
        labels: dict[str, str] | None = None,
        include_deleted: bool = False,
        latest_only: bool = False,
        page_size: int = 0,
    ) -> Iterator[registry_pb2.AdapterVersion]:
        """Every matching version, page after page."""
        token = ""
        while True:
            request = registry_pb2.ListAdaptersRequest(
                name=name,
                base_model=base_model,
                labels=labels or {},
                include_deleted=include_deleted,
                latest_only=latest_only,
                page_size=page_size,
                page_token=token,
            )
            page = self._call(self._stub.ListAdapters, request, registry_pb2.ListAdaptersResponse)
            yield from page.versions
            token = page.next_page_token
            if not token:
                return

    def download(
        self,
        ref: str,
        out_dir: Path,
        *,
        progress: Progress = _no_progress,
        timeout: float | None = None,
    ) -> registry_pb2.AdapterVersion:
        """Writes the version's files into ``out_dir``, each checked against its
        sha256 before it takes its final name."""
        stream = self._stub.DownloadAdapter(
            registry_pb2.DownloadAdapterRequest(ref=ref, chunk_size=CHUNK_BYTES), timeout=timeout
        )
        try:
            first: registry_pb2.DownloadAdapterResponse = next(stream)
            version = first.version
            writer = _FolderWriter(out_dir, list(version.files))
            try:
                for message in stream:
                    chunk = message.chunk
                    writer.write(chunk.file_index, chunk.offset, chunk.data)
                    progress(len(chunk.data))
                writer.finish()
            finally:
                writer.close()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return version

    def read_range(
        self, ref: str, file_index: int, offset: int, length: int, *, timeout: float | None = None
    ) -> Iterator[tuple[int, bytes]]:
        """Bytes ``offset`` to ``offset + length`` (0: to the end) of the version's file
        ``file_index``, as (offset, data) pieces in order. Unchecked: the server cannot check
        part of a file, so the caller hashes the whole file once every range arrived."""
        stub = self._stubs[next(self._next_stub) % len(self._stubs)]
        request = registry_pb2.DownloadAdapterRequest(
            ref=ref,
            chunk_size=CHUNK_BYTES,
            range=registry_pb2.ByteRange(file_index=file_index, offset=offset, length=length),
        )
        expected, end = offset, offset + length
        try:
            for message in stub.DownloadAdapter(request, timeout=timeout):
                if message.WhichOneof("payload") == "version":  # first: says where 0 ends
                    if not length and file_index < len(message.version.files):
                        end = message.version.files[file_index].size_bytes
                    continue
                chunk = message.chunk
                if chunk.file_index != file_index or chunk.offset != expected:
                    raise DataLoss(
                        f"ranged download out of order: got file {chunk.file_index} offset "
                        f"{chunk.offset}, expected file {file_index} offset {expected}"
                    )
                yield chunk.offset, chunk.data
                expected += len(chunk.data)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        if expected != end:
            raise DataLoss(
                f"ranged download of file {file_index} ended at byte {expected}, expected {end}"
            )

    def download_urls(
        self, ref: str, expires_in_seconds: int = 0
    ) -> registry_pb2.GetDownloadUrlsResponse:
        request = registry_pb2.GetDownloadUrlsRequest(
            ref=ref, expires_in_seconds=expires_in_seconds
        )
        return self._call(self._stub.GetDownloadUrls, request, registry_pb2.GetDownloadUrlsResponse)

    def download_presigned(
        self, ref: str, out_dir: Path, *, progress: Progress = _no_progress
    ) -> registry_pb2.AdapterVersion:
        """Fetches the files straight from the blob store over presigned URLs."""
        urls = self.download_urls(ref)
        writer = _FolderWriter(out_dir, [p.file for p in urls.files])
        try:
            for index, presigned in enumerate(urls.files):
                with urllib.request.urlopen(presigned.url, timeout=self.timeout) as response:
                    offset = 0
                    while data := response.read(CHUNK_BYTES):
                        writer.write(index, offset, data)
                        offset += len(data)
                        progress(len(data))
            writer.finish()
        finally:
            writer.close()
        return urls.version

    def set_alias(self, name: str, alias: str, version: int) -> registry_pb2.SetAliasResponse:
        request = registry_pb2.SetAliasRequest(name=name, alias=alias, version=version)
        return self._call(self._stub.SetAlias, request, registry_pb2.SetAliasResponse)

    def delete_alias(self, name: str, alias: str) -> int:
        request = registry_pb2.DeleteAliasRequest(name=name, alias=alias)
        return self._call(
            self._stub.DeleteAlias, request, registry_pb2.DeleteAliasResponse
        ).previous_version

    def delete(self, ref: str, refuse_if_aliased: bool = False) -> registry_pb2.AdapterVersion:
        """Soft-deletes ``ref`` (name:VERSION or name@sha256:HEX) and the aliases pointing at
        it; with ``refuse_if_aliased``, FailedPrecondition instead while any alias does."""
        request = registry_pb2.DeleteAdapterVersionRequest(
            ref=ref, refuse_if_aliased=refuse_if_aliased
        )
        return self._call(
            self._stub.DeleteAdapterVersion, request, registry_pb2.DeleteAdapterVersionResponse
        ).version

    def gc(
        self, grace_seconds: int = 0, dry_run: bool = False
    ) -> registry_pb2.GarbageCollectResponse:
        request = registry_pb2.GarbageCollectRequest(grace_seconds=grace_seconds, dry_run=dry_run)
        return self._call(
            self._stub.GarbageCollect,
            request,
            registry_pb2.GarbageCollectResponse,
            timeout=max(self.timeout, 600),
        )

    def watch(
        self, *, name: str = "", base_model: str = "", after_sequence: int = 0
    ) -> WatchStream:
        """Opens a change stream; returns once the server has started it."""
        request = registry_pb2.WatchAdaptersRequest(
            name=name, base_model=base_model, after_sequence=after_sequence
        )
        return WatchStream(self._stub.WatchAdapters(request))


class WatchStream:
    """An open WatchAdapters stream. ``start_sequence`` is where it starts:
    every event after it arrives, in order, until ``cancel``."""

    def __init__(self, call: Any) -> None:
        self._call = call
        metadata = dict(call.initial_metadata() or ())
        if WATCH_START_METADATA not in metadata:  # refused before it started
            self._raise()
        self.start_sequence = int(metadata[WATCH_START_METADATA])

    def _raise(self) -> None:
        try:
            next(self._call)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        raise DataLoss("WatchAdapters stream started without its start sequence")

    def __iter__(self) -> Iterator[registry_pb2.WatchAdaptersResponse]:
        try:
            yield from self._call
        except grpc.RpcError as exc:
            if self._call.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class _FolderWriter:
    """Receives a version's files into ``out_dir`` as ``.part`` files, hashing as
    it goes; ``finish`` checks sizes and sha256, then renames them into place."""

    def __init__(self, out_dir: Path, files: list[registry_pb2.AdapterFile]) -> None:
        for f in files:
            # The server names the files; never let it write outside out_dir.
            if f.path not in ADAPTER_FILES:
                raise DataLoss(f"server sent an unexpected file name {f.path!r}")
        out_dir.mkdir(parents=True, exist_ok=True)
        self._files = files
        self._parts = [out_dir / f"{f.path}.part" for f in files]
        self._writers = [BackgroundWriter(p) for p in self._parts]  # they hash as they write
        self._sizes = [0] * len(files)
        self._out_dir = out_dir

    def write(self, index: int, offset: int, data: bytes) -> None:
        if not 0 <= index < len(self._files) or offset != self._sizes[index]:
            raise DataLoss(f"download stream out of order at file {index} offset {offset}")
        self._writers[index].write(data)
        self._sizes[index] += len(data)

    def finish(self) -> None:
        for i, f in enumerate(self._files):
            digest = self._writers[i].close().sha256
            if self._sizes[i] != f.size_bytes or digest != f.sha256:
                raise DataLoss(
                    f"{f.path}: received {self._sizes[i]} bytes with sha256 {digest}, expected "
                    f"{f.size_bytes} bytes with sha256 {f.sha256}"
                )
        for part, f in zip(self._parts, self._files, strict=True):
            part.replace(self._out_dir / f.path)

    def close(self) -> None:
        for writer in self._writers:
            writer.discard()
