"""``moelora-registry migrate`` is idempotent on SQLite and PostgreSQL, a server that may not
migrate refuses a database at another schema revision, and each revision keeps the rows of the
one before (and gives them back on downgrade)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import MetaData, inspect, text

from registry_service.db import migrate
from registry_service.db.engine import Database
from registry_service.db.migrate import head_revision


def test_migrate_is_idempotent(start_server: Any, tmp_path: Path, database_url: str) -> None:
    for _ in range(2):
        run = start_server("moelora-registry", "migrate", "--database-url", database_url)
        assert run.proc.wait(60) == 0, run.log()
        printed = json.loads(run.log().strip().splitlines()[-1])
        assert printed["revision"] == head_revision()


def test_server_without_migration_refuses_an_old_schema(start_server: Any, tmp_path: Path) -> None:
    server = start_server(
        "moelora-registry",
        "--data-dir",
        str(tmp_path / "data"),
        "--no-migrate-on-start",
        "--metrics-listen",
        "",
    )
    assert server.proc.wait(60) == 1
    assert "run `moelora-registry migrate`" in server.log()


def _alembic(db: Database, verb: str, revision: str) -> None:
    with db.engine.begin() as connection:
        getattr(command, verb)(migrate._config(connection), revision)


def _file_columns(db: Database) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns("adapter_files")}


def _seed_0001(db: Database) -> None:
    """One READY version with one file, written as a 0001-era registry would have."""
    now = datetime(2026, 11, 1, tzinfo=UTC)
    tables = MetaData()
    tables.reflect(db.engine)
    rows = {
        "base_models": {
            "id": 1,
            "name": "base",
            "model_type": "qwen3_moe",
            "fingerprint": "sha256:" + "0" * 64,
            "hidden_size": 16,
            "moe_intermediate_size": 8,
            "num_experts": 4,
            "top_k": 2,
            "num_layers": 2,
            "moe_layers": [0, 1],
            "shared_expert_intermediate_size": 0,
            "checkpoint_dtype": "float32",
            "config_json": "{}",
            "created_at": now,
            "created_by": "test",
        },
        "adapters": {"id": 1, "name": "old", "created_at": now},
        "adapter_versions": {
            "id": 1,
            "adapter_id": 1,
            "version": 1,
            "status": "READY",
            "base_model_id": 1,
            "base_model_fingerprint": "sha256:" + "0" * 64,
            "digest": "sha256:" + "1" * 64,
            "size_bytes": 10,
            "description": "",
            "created_at": now,
            "created_by": "test",
            "heartbeat_at": now,
        },
        "blobs": {"key": "sha256/" + "2" * 64, "size_bytes": 10, "claimed_at": now},
        "adapter_files": {
            "id": 1,
            "version_id": 1,
            "path": "adapter_model.safetensors",
            "size_bytes": 10,
            "sha256": "2" * 64,
            "blob_key": "sha256/" + "2" * 64,
        },
    }
    with db.engine.begin() as connection:
        for table, row in rows.items():
            connection.execute(tables.tables[table].insert().values(**row))


def test_0002_adds_the_piece_columns_keeps_rows_and_downgrades(database_url: str) -> None:
    db = Database(database_url)
    try:
        _alembic(db, "upgrade", "0001")
        _seed_0001(db)
        assert not _file_columns(db) & {"part_size_bytes", "part_sha256"}

        _alembic(db, "upgrade", "0002")
        assert migrate.current_revision(db) == "0002"
        assert {"part_size_bytes", "part_sha256"} <= _file_columns(db)
        with db.engine.connect() as connection:
            row = connection.execute(
                text("SELECT path, sha256, part_size_bytes, part_sha256 FROM adapter_files")
            ).one()
        assert tuple(row) == ("adapter_model.safetensors", "2" * 64, None, None)

        _alembic(db, "downgrade", "0001")
        assert migrate.current_revision(db) == "0001"
        assert not _file_columns(db) & {"part_size_bytes", "part_sha256"}
        with db.engine.connect() as connection:
            kept = connection.execute(text("SELECT path, sha256, blob_key FROM adapter_files"))
            assert [tuple(r) for r in kept] == [
                ("adapter_model.safetensors", "2" * 64, "sha256/" + "2" * 64)
            ]
        assert migrate.upgrade(db) == head_revision()
    finally:
        db.dispose()


def test_gc_command_runs_without_a_server(start_server: Any, tmp_path: Path) -> None:
    """One-off commands open the registry without its background threads and close it."""
    run = start_server("moelora-registry", "gc", "--dry-run", "--data-dir", str(tmp_path / "d"))
    assert run.proc.wait(60) == 0, run.log()
    printed = json.loads(run.log().strip().splitlines()[-1])
    assert printed["dry_run"] is True
