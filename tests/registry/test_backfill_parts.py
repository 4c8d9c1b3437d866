"""``moelora-registry backfill-parts`` gives versions stored without per-piece sha256s (as
migration 0002 leaves them) their pieces from the stored blobs: READY and not yet collected
DELETED ones, on SQLite and PostgreSQL and both blob stores; a blob that fails its recorded
sha256 is reported as DATA_LOSS and its version left without pieces; a second run changes
nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
from sqlalchemy import select, update

from registry_service.db.models import FileRow
from tests.registry.conftest import BASE, BlobSetting, Served, register_base
from tests.registry.fixtures import write_adapter, write_adapter_of_size
from tests.registry.test_parts import MIB, WEIGHTS, assert_pieces

Rows = list[tuple[int, str, int | None, list[str] | None]]


def _rows(served: Served) -> Rows:
    with served.app.db.read() as s:
        query = select(
            FileRow.version_id, FileRow.path, FileRow.part_size_bytes, FileRow.part_sha256
        )
        return [tuple(r) for r in s.execute(query.order_by(FileRow.id))]  # type: ignore[misc]


def _forget_pieces(served: Served) -> None:
    """What migration 0002 leaves for files stored before it: NULL pieces."""
    with served.app.db.write() as s:
        s.execute(update(FileRow).values(part_size_bytes=None, part_sha256=None))


def _corrupt(blobs: BlobSetting, sha256: str) -> None:
    """Flips the last byte of the blob ``sha256`` where the store keeps it."""
    url = str(blobs.settings["blob_url"])
    if blobs.kind == "local":
        blob = Path(url.removeprefix("file://")) / "sha256" / sha256
        blob.chmod(0o644)
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0xFF
        blob.write_bytes(bytes(data))
        return
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=blobs.settings["s3_endpoint_url"], region_name="us-east-1")
    key = f"{prefix}/sha256/{sha256}"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def _backfill(start_server: Any, served: Served, blobs: BlobSetting) -> tuple[int, Any]:
    settings = served.settings
    flags = ["--data-dir", str(settings.data_dir), "--auth", "off", *blobs.flags()]
    if settings.database_url:
        flags += ["--database-url", settings.database_url]
    run = start_server("moelora-registry", "backfill-parts", "--part-size-bytes", str(MIB), *flags)
    code = run.proc.wait(120)
    return code, json.loads(run.log().strip().splitlines()[-1])


def test_backfill_fills_old_versions_refuses_a_corrupt_blob_and_is_idempotent(
    serve: Callable[..., Served],
    start_server: Any,
    database_url: str,
    blob_setting: BlobSetting,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    served = serve(
        database_url=database_url, part_size_bytes=MIB, max_rank=4096, **blob_setting.settings
    )
    folders = {
        "big": write_adapter_of_size(tmp_path / "big", 2 * MIB + 1),
        "small": write_adapter(tmp_path / "small", seed=2),
        "gone": write_adapter(tmp_path / "gone", seed=3),
        "bad": write_adapter(tmp_path / "bad", seed=4),
    }
    with served.client() as client:
        register_base(client, base_model_dir)
        uploaded = {name: client.upload(folder, name, BASE) for name, folder in folders.items()}
        client.delete("gone:1")  # DELETED, not collected: still downloadable by digest
    bad = next(f for f in uploaded["bad"].files if f.path == WEIGHTS)
    _forget_pieces(served)
    _corrupt(blob_setting, bad.sha256)
    with served.client() as client:
        old = client.get("big:1").files
        assert all((f.part_size_bytes, len(f.part_sha256)) == (0, 0) for f in old)

    code, report = _backfill(start_server, served, blob_setting)
    assert code == 1, report
    assert report["filled"] == ["big:1", "small:1", "gone:1"]
    assert list(report["failed"]) == ["bad:1"]
    assert report["failed"]["bad:1"].startswith("DATA_LOSS:")
    assert bad.sha256 in report["failed"]["bad:1"]

    with served.client() as client:
        for name in ("big", "small"):
            assert_pieces(client.get(f"{name}:1").files, folders[name])
        digest = uploaded["gone"].digest
        assert_pieces(client.get(f"gone@{digest}").files, folders["gone"])
        untouched = client.get("bad:1").files  # the config is fine, but the version is one
        assert all((f.part_size_bytes, len(f.part_sha256)) == (0, 0) for f in untouched)
        # What the backfill recorded is what the upload recorded.
        for name in ("big", "small", "gone"):
            again = {
                f.path: list(f.part_sha256)
                for f in client.get(f"{name}@{uploaded[name].digest}").files
            }
            assert again == {f.path: list(f.part_sha256) for f in uploaded[name].files}

    before = _rows(served)
    code, report = _backfill(start_server, served, blob_setting)
    assert (code, report["filled"], list(report["failed"])) == (1, [], ["bad:1"])
    assert _rows(served) == before
