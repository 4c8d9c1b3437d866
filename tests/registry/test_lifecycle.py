"""Versions, aliases, soft delete and digest resolution, lists with filters and
pages, gc, checksum failures, base-model registration rules."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from moelora.client.model_spec import read_model_spec
from registry_service.domain import Chunk, DeclaredFile, ListFilter, UploadHeader
from registry_service.service import Registry
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import write_adapter, write_base_model


def _code(error: pytest.ExceptionInfo[MoeLoraError]) -> grpc.StatusCode:
    return error.value.code


@pytest.fixture
def served(database_url: str, serve: Callable[..., Served], base_model_dir: Path) -> Served:
    registry = serve(database_url=database_url, gc_grace_seconds=0)
    with registry.client() as client:
        register_base(client, base_model_dir)
    return registry


def test_aliases_delete_digest_and_gc(served: Served, tmp_path: Path) -> None:
    client = served.client()
    v1 = client.upload(write_adapter(tmp_path / "a1", seed=1), "sql", BASE, alias="prod")
    v2 = client.upload(write_adapter(tmp_path / "a2", seed=2), "sql", BASE)
    assert (v1.version, v2.version) == (1, 2) and v1.digest != v2.digest
    assert client.get("sql").version == 2  # the newest READY version
    assert client.get("sql@prod").version == 1

    moved = client.set_alias("sql", "prod", 2)
    assert (moved.previous_version, list(moved.version.aliases)) == (1, ["prod"])
    assert client.set_alias("sql", "canary", 1).previous_version == 0
    assert sorted(client.get("sql:1").aliases) == ["canary"]
    with pytest.raises(MoeLoraError) as info:
        client.set_alias("sql", "prod", 9)
    assert _code(info) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(MoeLoraError) as info:
        client.set_alias("sql", "3", 1)  # aliases never look like versions
    assert _code(info) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.delete_alias("sql", "canary") == 1
    with pytest.raises(MoeLoraError) as info:
        client.delete_alias("sql", "canary")
    assert _code(info) == grpc.StatusCode.NOT_FOUND

    # Soft delete: gone by name, version and alias; still there by digest.
    with pytest.raises(MoeLoraError) as info:
        client.delete("sql@prod")
    assert _code(info) == grpc.StatusCode.INVALID_ARGUMENT and "does not pin" in info.value.message
    # The guard sits in the delete's own transaction: refused, and nothing changed.
    with pytest.raises(MoeLoraError) as info:
        client.delete("sql:2", refuse_if_aliased=True)
    assert _code(info) == grpc.StatusCode.FAILED_PRECONDITION
    assert "sql@prod points at" in info.value.message
    assert client.get("sql@prod").version == 2 and client.get("sql:2").status == 2
    deleted = client.delete("sql:2")
    assert deleted.status == 4 and deleted.HasField("delete_time")
    assert client.get("sql").version == 1
    for ref in ("sql:2", "sql@prod"):
        with pytest.raises(MoeLoraError) as info:
            client.get(ref)
        assert _code(info) == grpc.StatusCode.NOT_FOUND
    assert client.get(f"sql@{v2.digest}").status == 4
    assert client.delete(f"sql@{v2.digest}").version == 2  # deleting again changes nothing
    out = tmp_path / "by-digest"
    client.download(f"sql@{v2.digest}", out)
    assert (out / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "a2" / "adapter_model.safetensors"
    ).read_bytes()
    assert [v.version for v in client.list_versions(include_deleted=True)] == [2, 1]
    assert [v.version for v in client.list_versions()] == [1]

    # gc (grace 0 on this server): v2's own blobs go (the config is shared with
    # v1), v2 is purged, v1 is untouched.
    keys_v1 = {f"sha256/{f.sha256}" for f in v1.files}
    only_v2 = {f"sha256/{f.sha256}": f.size_bytes for f in v2.files}
    for key in keys_v1:
        only_v2.pop(key, None)
    assert len(only_v2) == 1
    dry = client.gc(dry_run=True)
    assert dry.purged_versions == 1 and set(dry.removed_blobs) == set(only_v2)
    assert len(list(served.app.registry.blobs.list_blobs())) == 3
    report = client.gc()
    assert set(report.removed_blobs) == set(only_v2) and report.purged_versions == 1
    assert report.removed_bytes == sum(only_v2.values())
    assert {b.key for b in served.app.registry.blobs.list_blobs()} == keys_v1
    with pytest.raises(MoeLoraError) as info:
        client.get(f"sql@{v2.digest}")
    assert _code(info) == grpc.StatusCode.NOT_FOUND
    client.download("sql:1", tmp_path / "still-there")
    assert client.gc().removed_blobs == []
    client.close()


def test_identical_content_shares_blobs_and_survives_gc(served: Served, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    with served.client() as client:
        first = client.upload(adapter, "one", BASE)
        second = client.upload(adapter, "two", BASE)
        assert first.digest == second.digest
        assert len(list(served.app.registry.blobs.list_blobs())) == 2
        client.delete("one:1")
        assert client.gc().removed_blobs == []  # "two" still needs them
        client.download("two:1", tmp_path / "out")


def test_list_filters_and_pages(served: Served, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    with served.client() as client:
        for name in ("b", "a", "c"):
            for _ in range(2):
                client.upload(adapter, name, BASE, labels={"team": "x" if name != "c" else "y"})
        every = [(v.name, v.version) for v in client.list_versions(page_size=4)]
        assert every == [("a", 2), ("a", 1), ("b", 2), ("b", 1), ("c", 2), ("c", 1)]
        assert [(v.name, v.version) for v in client.list_versions(latest_only=True)] == [
            ("a", 2),
            ("b", 2),
            ("c", 2),
        ]
        assert {v.name for v in client.list_versions(labels={"team": "y"})} == {"c"}
        assert [v.version for v in client.list_versions(name="b", page_size=1)] == [2, 1]
        assert list(client.list_versions(base_model="other")) == []
        client.delete("a:2")
        latest = [(v.name, v.version) for v in client.list_versions(latest_only=True)]
        assert latest == [("a", 1), ("b", 2), ("c", 2)]
        with pytest.raises(MoeLoraError) as info:
            list(client.list_versions(page_size=5000))
        assert _code(info) == grpc.StatusCode.INVALID_ARGUMENT
    registry = served.app.registry
    page = registry.list_versions(ListFilter(), 1, "")
    with pytest.raises(MoeLoraError) as info:  # a token only fits its own filters
        registry.list_versions(ListFilter(name="b"), 1, page.next_token)
    assert "other filters" in info.value.message


def test_corrupt_blob_is_data_loss(served: Served, tmp_path: Path) -> None:
    with served.client() as client:
        version = client.upload(write_adapter(tmp_path / "a"), "a", BASE)
        weights = next(f for f in version.files if f.path == "adapter_model.safetensors")
        blob = served.settings.data_path / "blobs" / "sha256" / weights.sha256
        blob.chmod(0o644)
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0xFF
        blob.write_bytes(bytes(data))
        with pytest.raises(MoeLoraError) as info:
            client.download("a:1", tmp_path / "out")
        assert _code(info) == grpc.StatusCode.DATA_LOSS and weights.sha256 in info.value.message
        assert not (tmp_path / "out" / "adapter_model.safetensors").exists()
        # Over the blob HTTP server's signed URLs the bytes come unchecked: the client checks.
        with pytest.raises(MoeLoraError) as info:
            client.download_presigned("a:1", tmp_path / "direct")
        assert _code(info) == grpc.StatusCode.DATA_LOSS and weights.sha256 in info.value.message
        assert not (tmp_path / "direct" / "adapter_model.safetensors").exists()


def test_base_model_registration_rules(served: Served, tmp_path: Path) -> None:
    other = write_base_model(tmp_path / "other", seed=7)
    with served.client() as client:
        again = client.register_base_model(read_model_spec(tmp_path / "other").to_proto("o"))
        assert again.created
        assert not client.register_base_model(read_model_spec(other).to_proto("o")).created
        with pytest.raises(MoeLoraError) as info:  # same name, other weights
            register_base(client, other, BASE)
        assert _code(info) == grpc.StatusCode.ALREADY_EXISTS
        tampered = read_model_spec(other).to_proto("t")
        tampered.hidden_size = 99
        with pytest.raises(MoeLoraError) as info:
            client.register_base_model(tampered)
        assert (
            _code(info) == grpc.StatusCode.INVALID_ARGUMENT and "hidden_size" in info.value.message
        )
        assert [m.name for m in client.list_base_models()] == ["o", BASE]
        stored = client.get_base_model(BASE)
        assert json.loads(stored.config_json)["model_type"] == "qwen3_moe"
        with pytest.raises(MoeLoraError) as info:
            client.get_base_model("nope")
        assert _code(info) == grpc.StatusCode.NOT_FOUND


class _GcWinsOnce(Registry):
    """A registry whose first READY commit finds its blobs gone, as when a gc
    running elsewhere removed an unreferenced blob the upload was about to reuse."""

    raced = False

    def _all_present(self, keys: Iterable[str]) -> bool:
        if not self.raced:
            self.raced = True
            for key in keys:
                self.blobs.delete(key)
        return super()._all_present(keys)


def test_upload_rewrites_blobs_that_gc_removed_meanwhile(served: Served, tmp_path: Path) -> None:
    app = served.app.registry
    racing = _GcWinsOnce(app.store, app.blobs, app.feed, app.collector, app.spool_dir, app.limits)
    folder = write_adapter(tmp_path / "a")
    files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
    header = UploadHeader(
        "raced", BASE, "", {}, None, [DeclaredFile(f.name, f.stat().st_size, None) for f in files]
    )
    chunks = [Chunk(i, 0, f.read_bytes()) for i, f in enumerate(files)]
    version = racing.upload(header, chunks, "test")
    assert racing.raced and version.version == 1
    with served.client() as client:
        client.download("raced:1", tmp_path / "out")  # every blob is there
