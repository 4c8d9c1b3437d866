"""``moelora-registry migrate`` is idempotent on SQLite and PostgreSQL, and a
server that may not migrate refuses a database at another schema revision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
