"""DownloadAdapter: byte ranges of one file (parallel ranged downloads) on both blob stores,
ranges outside the file refused naming the field, and a blob that went bad after upload: its
bytes are streamed, hashed on the way, and the stream ends with DATA_LOSS."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from moelora.client.registry import RegistryClient
from moelora.v1 import registry_pb2, registry_pb2_grpc
from registry_service.domain import ByteRange
from tests.registry.conftest import BASE, BlobSetting, Served, register_base
from tests.registry.fixtures import write_adapter

WEIGHTS = "adapter_model.safetensors"
#: Rank 256 on the tiny shape: 448 KiB of float32 weights, several 64 KiB chunks.
RANK = 256


@pytest.fixture
def served(serve: Callable[..., Served], blob_setting: BlobSetting, base_model_dir: Path) -> Served:
    registry = serve(**blob_setting.settings)
    with registry.client() as client:
        register_base(client, base_model_dir)
    return registry


def _read(client: RegistryClient, index: int, offset: int, length: int) -> bytes:
    pieces = list(client.read_range("a:1", index, offset, length))
    expected = offset
    for at, data in pieces:
        assert at == expected
        expected += len(data)
    return b"".join(data for _, data in pieces)


def test_ranges_reassemble_every_file_over_parallel_connections(
    served: Served, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "a", rank=RANK)
    with RegistryClient(served.address, connections=3) as client:
        version = client.upload(folder, "a", BASE)
        files = {f.path: i for i, f in enumerate(version.files)}
        weights = (folder / WEIGHTS).read_bytes()
        size = len(weights)
        cuts = [0, 1, 70_001, size // 2, size - 5, size]
        parts: dict[int, bytes] = {}

        def fetch(n: int) -> None:
            start, end = cuts[n], cuts[n + 1]
            parts[n] = _read(client, files[WEIGHTS], start, end - start)

        threads = [threading.Thread(target=fetch, args=(n,)) for n in range(len(cuts) - 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert b"".join(parts[n] for n in range(len(cuts) - 1)) == weights
        assert _read(client, files[WEIGHTS], size - 7, 0) == weights[-7:]  # 0: to the end
        assert _read(client, files[WEIGHTS], size, 0) == b""
        config = (folder / "adapter_config.json").read_bytes()
        assert _read(client, files["adapter_config.json"], 0, 0) == config


def test_ranges_outside_the_file_name_the_field(served: Served, tmp_path: Path) -> None:
    with served.client() as client:
        client.upload(write_adapter(tmp_path / "a"), "a", BASE)
        size = (tmp_path / "a" / WEIGHTS).stat().st_size
        for (index, offset, length), field in [
            ((2, 0, 0), "range.file_index"),
            ((1, size + 1, 0), "range.offset"),
            ((1, 10, size), "range.length"),
        ]:
            with pytest.raises(MoeLoraError) as info:
                _read(client, index, offset, length)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert info.value.message.startswith(field), info.value.message


def _damaged_upload(
    served: Served, blobs: BlobSetting, folder: Path, keep: int | None = None
) -> registry_pb2.AdapterVersion:
    """Uploads an adapter as ``a:1``, then flips the last byte of its weights' local blob (or
    keeps only the first ``keep`` bytes)."""
    with served.client() as client:
        version = client.upload(write_adapter(folder, rank=RANK), "a", BASE)
    weights = next(f for f in version.files if f.path == WEIGHTS)
    blob = Path(blobs.settings["blob_url"].removeprefix("file://")) / "sha256" / weights.sha256
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data if keep is None else data[:keep]))
    return version


@pytest.mark.parametrize("blob_setting", ["local"], indirect=True)
def test_a_corrupt_blob_is_streamed_then_fails_with_data_loss(
    served: Served, blob_setting: BlobSetting, tmp_path: Path
) -> None:
    version = _damaged_upload(served, blob_setting, tmp_path / "a")
    weights = next(f for f in version.files if f.path == WEIGHTS)
    stub = registry_pb2_grpc.AdapterRegistryStub(served.channel())
    received = 0
    with pytest.raises(grpc.RpcError) as info:
        request = registry_pb2.DownloadAdapterRequest(ref="a:1", chunk_size=64 * 1024)
        for message in stub.DownloadAdapter(request):
            received += len(message.chunk.data)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert weights.sha256 in (info.value.details() or "")
    # Hashed as it was sent: every byte went out before the verdict.
    assert received == sum(f.size_bytes for f in version.files)
    # A range is not checked by the server (part of a file cannot be): the client must.
    with served.client() as client:
        assert len(_read(client, 1, 0, 0)) == weights.size_bytes


@pytest.mark.parametrize("blob_setting", ["local"], indirect=True)
def test_a_truncated_blob_fails_with_data_loss(
    served: Served, blob_setting: BlobSetting, tmp_path: Path
) -> None:
    _damaged_upload(served, blob_setting, tmp_path / "a", keep=100_000)
    registry = served.app.registry
    for byte_range in (None, ByteRange(1, 90_000, 20_000)):
        _, chunks = registry.download("a:1", 64 * 1024, byte_range)
        with pytest.raises(MoeLoraError, match="truncated") as info:
            list(chunks)
        assert info.value.code == grpc.StatusCode.DATA_LOSS
