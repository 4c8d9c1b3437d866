"""Where versions uploaded before the registry recorded per-piece sha256s get them
(``moelora-registry backfill-parts``).

Each READY or DELETED (not yet collected) version with a file lacking pieces is read back from
the blob store, hashed whole and by pieces in one pass (the whole sha256 on the reading thread,
the pieces on this one), and its pieces are recorded only if every file's whole sha256 is the
one recorded at upload: a blob that fails it is reported as DATA_LOSS and its version left
unchanged. One version per transaction, and only files still without pieces are written, so a
run cut short resumes where it stopped and a second run changes nothing.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from sqlalchemy import select, update

from moelora.client.errors import DataLoss
from moelora.client.logs import log_event
from moelora.client.part_digests import PartHasher
from moelora.client.read_ahead import ReadAhead
from registry_service.blobs import BlobStore
from registry_service.db.engine import Database
from registry_service.db.models import AdapterRow, FileRow, VersionRow
from registry_service.domain import VersionStatus

log = logging.getLogger(__name__)

_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class _File:
    path: str
    size_bytes: int
    sha256: str
    blob_key: str


@dataclass
class BackfillReport:
    """``filled``: versions (``name:version``) given pieces; ``failed``: versions whose
    blobs did not match, with why."""

    filled: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def backfill_parts(db: Database, blobs: BlobStore, part_size: int) -> BackfillReport:
    report = BackfillReport()
    for version_id, label, files in _versions_missing_parts(db):
        try:
            parts = {f.path: _hash_parts(blobs, f, part_size, label) for f in files}
        except DataLoss as exc:
            report.failed[label] = f"DATA_LOSS: {exc}"
            log_event(log, "parts_backfill_failed", logging.WARNING, version=label, error=str(exc))
            continue
        if _record(db, version_id, part_size, parts):
            report.filled.append(label)
            log_event(log, "parts_backfilled", version=label, files=len(parts))
    return report


def _versions_missing_parts(db: Database) -> list[tuple[int, str, list[_File]]]:
    """(version id, ``name:version``, its files without pieces), oldest version first."""
    query = (
        select(VersionRow.id, AdapterRow.name, VersionRow.version, FileRow)
        .join(VersionRow.adapter)
        .join(FileRow, FileRow.version_id == VersionRow.id)
        .where(
            VersionRow.status.in_((VersionStatus.READY, VersionStatus.DELETED)),
            FileRow.part_size_bytes.is_(None),
        )
        .order_by(VersionRow.id, FileRow.path)
    )
    found: dict[int, tuple[str, list[_File]]] = {}
    with db.read() as s:
        for version_id, name, version, f in s.execute(query):
            _, files = found.setdefault(version_id, (f"{name}:{version}", []))
            files.append(_File(f.path, f.size_bytes, f.sha256, f.blob_key))
    return [(version_id, label, files) for version_id, (label, files) in found.items()]


def _hash_parts(blobs: BlobStore, f: _File, part_size: int, label: str) -> tuple[str, ...]:
    where = f"{label} {f.path}: blob {f.blob_key}"
    whole = hashlib.sha256()
    parts = PartHasher(part_size)
    try:
        with (
            blobs.open_range(f.blob_key, 0, f.size_bytes) as reader,
            ReadAhead(reader, f.size_bytes, _CHUNK_BYTES, whole, where) as ahead,
        ):
            for data in ahead:
                parts.update(data)
    except FileNotFoundError:
        raise DataLoss(f"{where} is missing from the blob store") from None
    if whole.hexdigest() != f.sha256:
        raise DataLoss(f"{where} has sha256 {whole.hexdigest()}, recorded {f.sha256}")
    return parts.finish()


def _record(
    db: Database, version_id: int, part_size: int, parts: dict[str, tuple[str, ...]]
) -> bool:
    """Writes the pieces of files still without them; whether any was written (not when gc
    purged the version or another run got there first)."""
    written = 0
    with db.write() as s:
        for path, digests in parts.items():
            result = s.execute(
                update(FileRow)
                .where(
                    FileRow.version_id == version_id,
                    FileRow.path == path,
                    FileRow.part_size_bytes.is_(None),
                )
                .values(part_size_bytes=part_size, part_sha256=list(digests))
            )
            written += result.rowcount  # type: ignore[attr-defined]
    return written > 0
