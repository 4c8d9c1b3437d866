"""Bad uploads are refused with the documented status code and a message naming
the problem, and leave nothing behind: no READY row, no blob, no spool file."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from sqlalchemy import func, select

from moelora.client.errors import MoeLoraError
from moelora.v1 import registry_pb2, registry_pb2_grpc
from registry_service.db.models import VersionRow
from registry_service.domain import VersionStatus
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import TinyShape, adapter_tensors, write_adapter, write_raw_weights

WEIGHTS = "adapter_model.safetensors"


def _truncated(folder: Path) -> None:
    write_adapter(folder)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:-100])


def _lying_sizes(folder: Path) -> None:
    write_adapter(folder)
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    header = {key: {"dtype": "F32", "shape": [16, 8], "data_offsets": [0, 512]}}
    write_raw_weights(folder, header, b"\0" * 100)


def _oversize_header(folder: Path) -> None:
    write_adapter(folder)
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", 100 * 1024 * 1024) + b"{" + b" " * 1000)


def _wrong_shapes(folder: Path) -> None:
    write_adapter(folder, shape=TinyShape(hidden=32))


def _nan(folder: Path) -> None:
    tensors = adapter_tensors()
    tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"][3, 2] = np.nan
    write_adapter(folder, tensors=tensors)


def _bad_config(folder: Path) -> None:
    write_adapter(folder)
    (folder / "adapter_config.json").write_text("{not json")


def _int_weights(folder: Path) -> None:
    write_adapter(folder, tensors={k: v.astype(np.int32) for k, v in adapter_tensors().items()})


def _valid(folder: Path) -> None:
    write_adapter(folder)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
# id: (make the folder, adapter name, base model, status code, message fragment)
CASES: dict[str, tuple[Callable[[Path], None], str, str, grpc.StatusCode, str]] = {
    "truncated": (_truncated, "a", BASE, INVALID, "truncated"),
    "lying-sizes": (_lying_sizes, "a", BASE, INVALID, "truncated"),
    "oversize-header": (_oversize_header, "a", BASE, INVALID, "larger than the limit"),
    "wrong-shapes": (_wrong_shapes, "a", BASE, INVALID, "fit neither"),
    "nan": (_nan, "a", BASE, INVALID, "layers.1.mlp.experts.lora_B.weight contains NaN"),
    "bad-config": (_bad_config, "a", BASE, INVALID, "adapter_config.json"),
    "int-weights": (_int_weights, "a", BASE, INVALID, "I32"),
    "dotdot-name": (_valid, "a..b", BASE, INVALID, "header.name"),
    "slash-name": (_valid, "team/a", BASE, INVALID, "header.name"),
    "control-name": (_valid, "a\x07b", BASE, INVALID, "header.name"),
    "unregistered-base": (
        _valid,
        "a",
        "no-such-model",
        grpc.StatusCode.FAILED_PRECONDITION,
        "not registered",
    ),
}


def _count(served: Served, *statuses: VersionStatus) -> int:
    with served.app.db.read() as s:
        query = select(func.count()).select_from(VersionRow)
        return int(s.scalar(query.where(VersionRow.status.in_(statuses))) or 0)


def _assert_nothing_left(served: Served) -> None:
    assert _count(served, VersionStatus.READY, VersionStatus.PENDING) == 0
    assert list(served.app.registry.blobs.list_blobs()) == []
    spool = served.app.registry.spool_dir
    assert not spool.exists() or list(spool.iterdir()) == []


@pytest.fixture
def served(serve: Callable[..., Served], base_model_dir: Path) -> Served:
    registry = serve()
    with registry.client() as client:
        register_base(client, base_model_dir)
    return registry


@pytest.mark.parametrize("case", CASES)
def test_bad_upload_is_refused_and_leaves_nothing(
    served: Served, tmp_path: Path, case: str
) -> None:
    make, name, base, code, fragment = CASES[case]
    folder = tmp_path / "adapter"
    make(folder)
    with served.client() as client, pytest.raises(MoeLoraError) as info:
        client.upload(folder, name, base)
    assert info.value.code == code, info.value.message
    assert fragment in info.value.message
    _assert_nothing_left(served)
    # The registry keeps working, and numbers only READY versions: 1 comes next.
    with served.client() as client:
        assert client.upload(write_adapter(tmp_path / "good"), "after", BASE).version == 1


def test_rank_above_the_limit(
    serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path
) -> None:
    served = serve(max_rank=8)
    with served.client() as client:
        register_base(client, base_model_dir)
        assert client.upload(write_adapter(tmp_path / "r8", rank=8), "ok", BASE).rank == 8
        with pytest.raises(MoeLoraError) as info:
            client.upload(write_adapter(tmp_path / "r16", rank=16), "big", BASE)
        assert [v.name for v in client.list_versions()] == ["ok"]
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "16" in info.value.message and "8" in info.value.message


def test_file_over_the_size_limit(
    serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path
) -> None:
    served = serve(max_upload_bytes=4096)
    with served.client() as client:
        register_base(client, base_model_dir)
        with pytest.raises(MoeLoraError) as info:
            client.upload(write_adapter(tmp_path / "a"), "a", BASE)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert WEIGHTS in info.value.message and "4096" in info.value.message
    _assert_nothing_left(served)


def _raw_upload(served: Served, messages: list[registry_pb2.UploadAdapterRequest]) -> grpc.Call:
    with served.channel() as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.UploadAdapter(iter(messages), timeout=30)
    assert isinstance(info.value, grpc.Call)
    return info.value


def _header(folder: Path) -> registry_pb2.UploadAdapterRequest:
    files = [
        registry_pb2.AdapterFile(path=name, size_bytes=(folder / name).stat().st_size)
        for name in ("adapter_config.json", WEIGHTS)
    ]
    header = registry_pb2.UploadHeader(name="raw", base_model=BASE, files=files)
    return registry_pb2.UploadAdapterRequest(header=header)


def _chunks(folder: Path) -> Iterator[registry_pb2.UploadAdapterRequest]:
    for index, name in enumerate(("adapter_config.json", WEIGHTS)):
        chunk = registry_pb2.FileChunk(
            file_index=index, offset=0, data=(folder / name).read_bytes()
        )
        yield registry_pb2.UploadAdapterRequest(chunk=chunk)


def test_stream_protocol_errors(served: Served, tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    header = _header(folder)
    config, weights = list(_chunks(folder))

    missing = _raw_upload(served, [config])
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header missing" in missing.details()
    assert "header repeated" in _raw_upload(served, [header, header]).details()
    assert "out of order" in _raw_upload(served, [header, weights, config]).details()
    assert "upload ended after 0 of" in _raw_upload(served, [header, config]).details()

    lying = _header(folder)
    lying.header.files[1].sha256 = "0" * 64
    mismatch = _raw_upload(served, [lying, config, weights])
    assert mismatch.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sha256" in mismatch.details() and WEIGHTS in mismatch.details()

    extra = _header(folder)
    extra.header.files.append(registry_pb2.AdapterFile(path="extra.bin", size_bytes=1))
    assert "header.files" in _raw_upload(served, [extra]).details()

    _assert_nothing_left(served)
    # Every stream whose header passed left a FAILED record (invisible; gc purges it).
    assert _count(served, VersionStatus.FAILED) == 4


def test_trailer_errors_name_the_field(served: Served, tmp_path: Path) -> None:
    """The trailer carries every file's sha256 after the bytes: checked against them, against
    the header's where given, and it must come last, once, with one value per file."""
    folder = write_adapter(tmp_path / "a")
    header = _header(folder)
    config, weights = list(_chunks(folder))
    genuine = [
        hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("adapter_config.json", WEIGHTS)
    ]

    def trailer(*sha256: str) -> registry_pb2.UploadAdapterRequest:
        return registry_pb2.UploadAdapterRequest(trailer=registry_pb2.UploadTrailer(sha256=sha256))

    wrong = _raw_upload(served, [header, config, weights, trailer(genuine[0], "1" * 64)])
    assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wrong.details().startswith(f"{WEIGHTS}: sha256 of the bytes received"), wrong.details()
    assert "the trailer says " + "1" * 64 in wrong.details()
    for messages, fragment in [
        ([header, config, weights, trailer(genuine[0])], "trailer.sha256: 1 values"),
        ([header, config, weights, trailer(genuine[0], "XYZ")], "trailer.sha256: 'XYZ'"),
        ([header, config, trailer(*genuine), weights], "chunk after the trailer"),
        ([header, config, weights, trailer(*genuine), trailer(*genuine)], "trailer repeated"),
    ]:
        refused = _raw_upload(served, messages)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in refused.details(), refused.details()
    disagree = _header(folder)
    disagree.header.files[1].sha256 = "2" * 64
    refused = _raw_upload(served, [disagree, config, weights, trailer(*genuine)])
    assert "in the trailer but " + "2" * 64 + " in the header" in refused.details()
    _assert_nothing_left(served)
    # A correct trailer is accepted (what RegistryClient.upload sends).
    with served.channel() as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        done = stub.UploadAdapter(iter([header, config, weights, trailer(*genuine)]), timeout=30)
    assert [f.sha256 for f in done.version.files] == genuine


def test_doomed_upload_fails_before_its_weights_arrive(served: Served, tmp_path: Path) -> None:
    """A header that cannot fit the base model is refused from the stream's first
    bytes: the client has not finished sending when the error comes back."""
    folder = write_adapter(tmp_path / "a", shape=TinyShape(hidden=32))
    header = _header(folder)
    config, weights = list(_chunks(folder))
    first_part = registry_pb2.UploadAdapterRequest(
        chunk=registry_pb2.FileChunk(file_index=1, offset=0, data=weights.chunk.data[:-64])
    )
    release = threading.Event()

    def stalled() -> Iterator[registry_pb2.UploadAdapterRequest]:
        yield from (header, config, first_part)
        release.wait(30)

    with served.channel() as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.UploadAdapter(stalled(), timeout=20)
        assert not release.is_set()
        release.set()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fit neither" in info.value.details()
    _assert_nothing_left(served)
