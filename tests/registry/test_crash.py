"""A registry killed (SIGKILL) in the middle of an upload leaves no visible
adapter; after a restart uploads work and gc removes what the crash left: the
PENDING record, the spooled bytes and an orphaned blob."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from moelora.client.errors import MoeLoraError
from moelora.client.registry import RegistryClient
from moelora.v1 import registry_pb2, registry_pb2_grpc
from registry_service.blobs.local import LocalBlobStore
from registry_service.db.engine import Database, sqlite_url
from registry_service.db.models import VersionRow
from registry_service.store import Store
from tests.conftest import wait_for
from tests.registry.conftest import BASE, launch_registry, register_base
from tests.registry.fixtures import write_adapter

FILES = ("adapter_config.json", "adapter_model.safetensors")


def _stalled_upload(
    folder: Path, release: threading.Event
) -> Iterator[registry_pb2.UploadAdapterRequest]:
    """Header, the config, the first KiB of the weights, then nothing until released."""
    data = [(folder / name).read_bytes() for name in FILES]
    yield registry_pb2.UploadAdapterRequest(
        header=registry_pb2.UploadHeader(
            name="crash",
            base_model=BASE,
            files=[
                registry_pb2.AdapterFile(path=n, size_bytes=len(d))
                for n, d in zip(FILES, data, strict=True)
            ],
        )
    )
    yield registry_pb2.UploadAdapterRequest(
        chunk=registry_pb2.FileChunk(file_index=0, data=data[0])
    )
    yield registry_pb2.UploadAdapterRequest(
        chunk=registry_pb2.FileChunk(file_index=1, offset=0, data=data[1][:1024])
    )
    release.wait(60)


def test_kill_mid_upload_then_restart_and_gc(
    start_server: Any, tmp_path: Path, base_model_dir: Path
) -> None:
    data_dir = tmp_path / "data"
    flags = ("--auth", "off", "--gc-grace-seconds", "0")
    first = launch_registry(start_server, data_dir, *flags)
    with RegistryClient(first.address) as client:
        register_base(client, base_model_dir)
    adapter = write_adapter(tmp_path / "adapter", rank=16)

    release = threading.Event()
    outcome: dict[str, grpc.StatusCode] = {}

    def upload() -> None:
        with grpc.insecure_channel(first.address) as channel:
            stub = registry_pb2_grpc.AdapterRegistryStub(channel)
            try:
                stub.UploadAdapter(_stalled_upload(adapter, release), timeout=60)
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

    uploader = threading.Thread(target=upload)
    uploader.start()
    spool = data_dir / "spool"
    # The spool file appears once the server accepted the header and began the upload.
    wait_for(lambda: any(spool.glob("upload-*/adapter_model.safetensors")))
    first.process.proc.send_signal(signal.SIGKILL)
    assert first.process.proc.wait(30) == -signal.SIGKILL
    release.set()
    uploader.join(30)
    assert outcome["code"] == grpc.StatusCode.UNAVAILABLE

    # What a crash between a blob write and its commit would leave.
    orphan = tmp_path / "orphan.bin"
    orphan.write_bytes(os.urandom(64))
    orphan_key = f"sha256/{hashlib.sha256(orphan.read_bytes()).hexdigest()}"
    LocalBlobStore(data_dir / "blobs").put_file(orphan_key, orphan)

    second = launch_registry(start_server, data_dir, *flags)
    db = Database(sqlite_url(data_dir / "registry.db"))
    with RegistryClient(second.address) as client:
        assert list(client.list_versions(include_deleted=True)) == []
        with pytest.raises(MoeLoraError) as info:
            client.get("crash")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with db.read() as s:
            statuses = [row.status for row in s.scalars(select(VersionRow))]
        assert statuses == ["PENDING"]  # recorded, never visible

        assert client.upload(adapter, "crash", BASE).version == 1
        report = client.gc()
        assert report.purged_versions == 1
        assert list(report.removed_blobs) == [orphan_key]
        assert list(spool.iterdir()) == []
        assert client.get("crash").version == 1
        client.download("crash", tmp_path / "out")
    assert Store(db).last_sequence() == 1
    db.dispose()
