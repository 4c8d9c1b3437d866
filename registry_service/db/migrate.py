"""Where the schema is brought up to date: Alembic driven from code, by
``moelora-registry migrate`` and at start-up (``migrate_on_start``).

Several replicas may start at once on PostgreSQL: an advisory lock lets one
migrate while the others wait, then find nothing left to do.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from moelora.client.errors import FailedPrecondition
from moelora.client.logs import log_event
from registry_service.db.engine import Database

log = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# Any constant shared by all replicas; "moelora" in ASCII.
_ADVISORY_LOCK_ID = 0x6D6F656C6F7261


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def current_revision(db: Database) -> str | None:
    with db.engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(db: Database) -> str:
    """Applies every pending revision; returns the revision now current.
    Idempotent: on an up-to-date database it changes nothing."""
    before = current_revision(db)
    with db.engine.begin() as connection:
        if db.dialect == "postgresql":
            # Held until this transaction ends, so concurrent migrators queue.
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _ADVISORY_LOCK_ID})
        command.upgrade(_config(connection), "head")
    after = current_revision(db)
    assert after is not None
    log_event(log, "database_migrated", database=db.safe_url, before=before, after=after)
    return after


def require_current(db: Database) -> None:
    """Refuses to serve an older (or newer) schema than this build's."""
    current, head = current_revision(db), head_revision()
    if current != head:
        raise FailedPrecondition(
            f"database schema is at revision {current or 'none'} but this build needs {head}: "
            "run `moelora-registry migrate` (or start with --migrate-on-start)"
        )
