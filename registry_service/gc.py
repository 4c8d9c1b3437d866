"""Where unreferenced blobs and dead versions are removed.

A run, with cutoff = now - grace:

1. plan (one transaction): purge DELETED versions deleted before the cutoff,
   FAILED versions and abandoned PENDING uploads (no heartbeat since the
   cutoff), adapters left without versions, and events older than the event
   retention; adopt store objects that have no blob row (writes cut off by a
   crash) with their modification time as claim time; pick the blob rows no
   file references and nobody claimed since the cutoff.
2. remove, one blob per transaction: delete the row only if it is still
   unreferenced and unclaimed (the DELETE takes the row lock), delete the
   object while holding that lock, then commit. An upload that wants the same
   blob claims the row first (upsert, which waits for our lock) and checks
   that the object exists under its own lock before it commits READY, so it
   either keeps the blob alive or sees it gone and writes it again.
3. remove temporaries of writes that never completed.

A dry run does step 1 and rolls it back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, exists, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from moelora.client.logs import log_event
from registry_service.blobs.base import BlobStat, BlobStore
from registry_service.db.engine import Database
from registry_service.db.models import (
    AdapterRow,
    AliasRow,
    BlobRow,
    EventRow,
    FileRow,
    VersionRow,
)
from registry_service.domain import GcReport, VersionStatus
from registry_service.store import utcnow

log = logging.getLogger(__name__)


class GarbageCollector:
    def __init__(
        self,
        db: Database,
        blobs: BlobStore,
        spool_dir: Path,
        event_retention_seconds: int,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._db = db
        self._blobs = blobs
        self._spool_dir = spool_dir
        self._event_retention = timedelta(seconds=event_retention_seconds)
        self._clock = clock

    def collect(self, grace_seconds: int, dry_run: bool) -> GcReport:
        now = self._clock()
        cutoff = now - timedelta(seconds=grace_seconds)
        listing = list(self._blobs.list_blobs())
        with self._db.write() as s:
            purged = self._purge_versions(s, cutoff)
            self._prune(s, now - self._event_retention)
            self._adopt(s, listing)
            s.flush()
            candidates = self._unreferenced(s, cutoff)
            if dry_run:
                s.rollback()
        removed: list[str] = []
        removed_bytes = 0
        for key, size in candidates:
            if dry_run or self._remove(key, cutoff):
                removed.append(key)
                removed_bytes += size
        temporaries = self._blobs.remove_stale_temporaries(cutoff, dry_run)
        temporaries += self._remove_stale_spool(cutoff, dry_run)
        log_event(
            log,
            "gc_done",
            dry_run=dry_run,
            grace_seconds=grace_seconds,
            removed_blobs=len(removed),
            removed_bytes=removed_bytes,
            purged_versions=purged,
            temporaries=temporaries,
        )
        return GcReport(removed, removed_bytes, purged)

    def _purge_versions(self, s: Session, cutoff: datetime) -> int:
        dead = or_(
            (VersionRow.status == VersionStatus.DELETED) & (VersionRow.deleted_at < cutoff),
            VersionRow.status.in_((VersionStatus.FAILED, VersionStatus.PENDING))
            & (VersionRow.heartbeat_at < cutoff),
        )
        rows = list(s.scalars(select(VersionRow).where(dead)))
        for row in rows:
            s.delete(row)  # files and labels go with it (cascade)
        s.flush()
        s.execute(
            delete(AdapterRow).where(
                ~exists().where(VersionRow.adapter_id == AdapterRow.id),
                ~exists().where(AliasRow.adapter_id == AdapterRow.id),
            )
        )
        return len(rows)

    def _prune(self, s: Session, before: datetime) -> None:
        s.execute(delete(EventRow).where(EventRow.created_at < before))

    def _adopt(self, s: Session, listing: list[BlobStat]) -> None:
        if not listing:
            return
        insert = pg_insert if self._db.dialect == "postgresql" else sqlite_insert
        rows = [
            {"key": b.key, "size_bytes": b.size_bytes, "claimed_at": b.modified} for b in listing
        ]
        for start in range(0, len(rows), 500):
            s.execute(insert(BlobRow).values(rows[start : start + 500]).on_conflict_do_nothing())

    def _unreferenced(self, s: Session, cutoff: datetime) -> list[tuple[str, int]]:
        query = (
            select(BlobRow.key, BlobRow.size_bytes)
            .where(BlobRow.claimed_at < cutoff, ~exists().where(FileRow.blob_key == BlobRow.key))
            .order_by(BlobRow.key)
        )
        return [(key, size) for key, size in s.execute(query)]

    def _remove(self, key: str, cutoff: datetime) -> bool:
        with self._db.write() as s:
            gone = s.execute(
                delete(BlobRow).where(
                    BlobRow.key == key,
                    BlobRow.claimed_at < cutoff,
                    ~exists().where(FileRow.blob_key == BlobRow.key),
                )
            )
            if gone.rowcount != 1:  # type: ignore[attr-defined]
                return False
            # Still inside the transaction: a failed delete rolls the row back.
            self._blobs.delete(key)
        return True

    def _remove_stale_spool(self, cutoff: datetime, dry_run: bool) -> int:
        """Spool folders of uploads and downloads cut off by a crash. An upload in
        progress writes its part files, so the newest mtime inside says it is alive."""
        if not self._spool_dir.is_dir():
            return 0
        removed = 0
        for entry in self._spool_dir.iterdir():
            parts = list(entry.iterdir()) if entry.is_dir() else []
            newest = max(p.stat().st_mtime for p in [entry, *parts])
            if datetime.fromtimestamp(newest, cutoff.tzinfo) >= cutoff:
                continue
            removed += 1
            if not dry_run:
                for part in parts:
                    part.unlink(missing_ok=True)
                if entry.is_dir():
                    entry.rmdir()
                else:
                    entry.unlink(missing_ok=True)
        return removed


class PeriodicGc:
    """Runs ``collect`` every ``interval_seconds`` in a daemon thread, so what crashes leave
    behind (abandoned uploads, temporaries, unreferenced blobs) goes without an operator.
    Replicas may each run it: a run's removals are safe against each other (see above)."""

    def __init__(self, collect: Callable[[], GcReport], interval_seconds: float) -> None:
        self._collect = collect
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="periodic-gc", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                report = self._collect()
            except Exception as exc:  # the next run tries again
                log_event(log, "periodic_gc_failed", logging.ERROR, error=str(exc))
                continue
            log_event(
                log,
                "periodic_gc_done",
                removed_blobs=len(report.removed_blobs),
                removed_bytes=report.removed_bytes,
                purged_versions=report.purged_versions,
            )
