"""Per-piece sha256s (AdapterFile.part_size_bytes / part_sha256): recorded at upload
from the bytes received, on both blob stores, for files that are an exact multiple of the
piece size, one byte over, and smaller than one piece; carried by every single-version answer,
left out of ListAdapters; refused in upload headers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import pytest

from moelora.v1 import registry_pb2, registry_pb2_grpc
from tests.registry.conftest import BASE, BlobSetting, Served, register_base
from tests.registry.fixtures import write_adapter, write_adapter_of_size

MIB = 1024 * 1024
WEIGHTS = "adapter_model.safetensors"
#: Weights sizes against a 1 MiB piece: (size, pieces expected).
SIZES = {"multiple": (2 * MIB, 2), "one-over": (2 * MIB + 1, 3), "under-one": (5000, 1)}


def pieces(data: bytes, part_size: int = MIB) -> list[str]:
    """The expected digests, computed independently: hashlib over each slice."""
    return [
        hashlib.sha256(data[at : at + part_size]).hexdigest()
        for at in range(0, len(data), part_size)
    ]


def assert_pieces(files: Iterable[registry_pb2.AdapterFile], folder: Path) -> None:
    seen = set()
    for f in files:
        data = (folder / f.path).read_bytes()
        assert f.sha256 == hashlib.sha256(data).hexdigest()
        assert f.part_size_bytes == MIB, f.path
        assert list(f.part_sha256) == pieces(data), f.path
        seen.add(f.path)
    assert seen == {"adapter_config.json", WEIGHTS}


@pytest.fixture
def served(serve: Callable[..., Served], blob_setting: BlobSetting, base_model_dir: Path) -> Served:
    registry = serve(
        part_size_bytes=MIB, max_rank=4096, http_listen="127.0.0.1:0", **blob_setting.settings
    )
    with registry.client() as client:
        register_base(client, base_model_dir)
    return registry


def test_every_single_version_answer_carries_the_pieces(served: Served, tmp_path: Path) -> None:
    with served.client() as client:
        for name, (size, count) in SIZES.items():
            folder = write_adapter_of_size(tmp_path / name, size)
            uploaded = client.upload(folder, name, BASE)
            weights = next(f for f in uploaded.files if f.path == WEIGHTS)
            assert (weights.size_bytes, len(weights.part_sha256)) == (size, count)
            assert_pieces(uploaded.files, folder)
            assert_pieces(client.get(f"{name}:1").files, folder)
            urls = client.download_urls(f"{name}:1")
            assert_pieces(urls.version.files, folder)
            assert_pieces([p.file for p in urls.files], folder)
            header = client.download(f"{name}:1", tmp_path / f"{name}-out")  # the first message
            assert_pieces(header.files, folder)
            assert_pieces(client.set_alias(name, "prod", 1).version.files, folder)

        listed = list(client.list_versions())
        assert sorted(v.name for v in listed) == sorted(SIZES)
        for version in listed:  # a page stays small: no pieces, the sha256 is there
            for f in version.files:
                assert (f.part_size_bytes, list(f.part_sha256)) == (0, [])
                assert len(f.sha256) == 64

        deleted = client.delete("one-over:1")
        assert_pieces(deleted.files, tmp_path / "one-over")


def test_chunks_straddling_pieces_hash_the_same(served: Served, tmp_path: Path) -> None:
    """Senders may cut chunks anywhere: odd-sized chunks across piece boundaries give the
    same pieces as the 1 MiB chunks of the client."""
    folder = write_adapter_of_size(tmp_path / "odd", 3 * MIB + 12345)
    files = [folder / "adapter_config.json", folder / WEIGHTS]
    header = registry_pb2.UploadHeader(
        name="odd",
        base_model=BASE,
        files=[registry_pb2.AdapterFile(path=p.name, size_bytes=p.stat().st_size) for p in files],
    )
    messages = [registry_pb2.UploadAdapterRequest(header=header)]
    for index, path in enumerate(files):
        data = path.read_bytes()
        step = 700_001  # a prime-ish size: every piece boundary falls inside a chunk
        for at in range(0, len(data), step):
            chunk = registry_pb2.FileChunk(file_index=index, offset=at, data=data[at : at + step])
            messages.append(registry_pb2.UploadAdapterRequest(chunk=chunk))
    with served.channel() as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        answer = stub.UploadAdapter(iter(messages), timeout=60)
    assert_pieces(answer.version.files, folder)


@pytest.mark.parametrize("blob_setting", ["local"], indirect=True)
@pytest.mark.parametrize(
    ("index", "field", "value"),
    [(1, "part_sha256", ["0" * 64]), (0, "part_size_bytes", MIB)],
)
def test_a_header_with_pieces_is_refused_naming_the_field(
    served: Served, tmp_path: Path, index: int, field: str, value: object
) -> None:
    folder = write_adapter(tmp_path / "a")
    files = [
        registry_pb2.AdapterFile(path=name, size_bytes=(folder / name).stat().st_size)
        for name in ("adapter_config.json", WEIGHTS)
    ]
    if field == "part_sha256":
        assert isinstance(value, list)
        files[index].part_sha256.extend(value)
    else:
        assert isinstance(value, int)
        files[index].part_size_bytes = value
    header = registry_pb2.UploadHeader(name="a", base_model=BASE, files=files)
    with served.channel() as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.UploadAdapter(iter([registry_pb2.UploadAdapterRequest(header=header)]), timeout=30)
    error = info.value
    assert isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"header.files[{index}].{field}" in (error.details() or "")
