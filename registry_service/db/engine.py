"""Where database connections are made: engines, transactions, and retries of
transactions that lost a race.

SQLite runs in WAL mode with foreign keys on; write transactions start with
``BEGIN IMMEDIATE`` so that two writers queue on the lock instead of failing
when one upgrades a read snapshot. PostgreSQL uses READ COMMITTED; races on
unique keys surface as IntegrityError and the transaction is retried whole.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from moelora.client.logs import log_event
from registry_service import metrics
from registry_service.disk_full import is_disk_full, storage_full

log = logging.getLogger(__name__)

T = TypeVar("T")

_WRITE_OPTION = "moelora_write"
_WAL_LIMIT_BYTES = 1024 * 1024
_RETRIES = 8


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event decide how transactions start.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        # After a checkpoint the write-ahead log shrinks back to this, rather than keeping the
        # largest size it ever had (space a full volume needs back).
        cursor.execute(f"PRAGMA journal_size_limit={_WAL_LIMIT_BYTES}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get(_WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class Database:
    """An engine plus read and write transactions over it."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self.dialect = parsed.get_backend_name()
        if self.dialect == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(parsed, connect_args={"timeout": 30})
            _configure_sqlite(engine)
        elif self.dialect == "postgresql":
            engine = create_engine(parsed, pool_pre_ping=True, pool_size=10, max_overflow=20)
        else:
            raise ValueError(
                f"database_url: unsupported database {self.dialect!r}; "
                "use sqlite:///PATH or postgresql+psycopg://..."
            )
        self.engine = engine
        self._reads = sessionmaker(engine, expire_on_commit=False)
        self._writes = sessionmaker(
            engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )

    def give_back_space(self) -> None:
        """SQLite: moves the write-ahead log into the database and truncates it, handing its
        pages back to the volume (after gc freed rows); nothing for PostgreSQL."""
        if self.dialect == "sqlite":
            with self.engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    @property
    def safe_url(self) -> str:
        """The URL without its password, for logs."""
        return self.engine.url.render_as_string(hide_password=True)

    @contextmanager
    def read(self) -> Iterator[Session]:
        with _counting_failures(), self._reads() as session, session.begin():
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One write transaction: committed when the block ends, rolled back on error; a full
        disk is RESOURCE_EXHAUSTED (registry_service.disk_full)."""
        try:
            with _counting_failures(), self._writes() as session, session.begin():
                yield session
        except OperationalError as exc:
            if is_disk_full(exc):
                raise storage_full() from exc
            raise

    def write_retrying(self, work: Callable[[Session], T]) -> T:
        """Runs ``work`` in a write transaction, again from the start when it lost
        a race (a unique key taken meanwhile, a lock timeout, a deadlock)."""
        for attempt in range(1, _RETRIES + 1):
            try:
                with self.write() as session:
                    return work(session)
            except (IntegrityError, OperationalError) as exc:
                if attempt == _RETRIES or not _is_race(exc):
                    raise
                log_event(log, "transaction_retry", logging.DEBUG, attempt=attempt, error=str(exc))
                time.sleep(random.uniform(0.005, 0.02) * attempt)
        raise AssertionError("unreachable")

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def _counting_failures() -> Iterator[None]:
    """Counts the database's failures (moelora_registry_database_errors_total): not a
    constraint that refused a row, nor a race that the transaction is retried after."""
    try:
        yield
    except PoolTimeout:
        metrics.DATABASE_ERRORS.inc()
        raise
    except DBAPIError as exc:
        if not isinstance(exc, IntegrityError) and not _is_race(exc):
            metrics.DATABASE_ERRORS.inc()
        raise


def _is_race(exc: DBAPIError) -> bool:
    text = str(exc.orig)
    if isinstance(exc, IntegrityError):
        # Only a unique key taken by a concurrent transaction; other integrity
        # errors are bugs and must not be retried.
        return getattr(exc.orig, "sqlstate", None) == "23505" or "UNIQUE constraint" in text
    # SQLite: busy beyond the timeout; PostgreSQL: deadlock or serialization failure.
    return getattr(exc.orig, "sqlstate", None) in ("40P01", "40001") or "locked" in text
