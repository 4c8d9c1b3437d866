"""Where adapter metadata is read and written: the SQL repository.

Every method is one transaction. Races between replicas are settled by the
database: version numbers under the unique (adapter_id, version) key, names
under their unique keys, event sequences under the counter row's lock; a
transaction that loses is retried whole (``Database.write_retrying``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, aliased

from moelora.client.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from moelora.client.model_spec import ModelSpec, spec_from_config
from registry_service.db.engine import Database
from registry_service.db.models import (
    AdapterRow,
    AliasRow,
    BaseModelRow,
    BlobRow,
    EventCounterRow,
    EventRow,
    FileRow,
    LabelRow,
    ServerKeyRow,
    VersionRow,
)
from registry_service.domain import (
    AdapterSummary,
    AliasChange,
    Event,
    EventType,
    FileInfo,
    ListFilter,
    StoredFile,
    UploadHeader,
    VersionInfo,
    VersionStatus,
)
from shared.refs import AdapterRef

VISIBLE = (VersionStatus.READY, VersionStatus.DELETED)


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class BaseModelRecord:
    name: str
    spec: ModelSpec
    create_time: datetime
    created_by: str


@dataclass(frozen=True)
class PendingUpload:
    """A PENDING version row and the base model it will be validated against."""

    id: int
    base_model: BaseModelRecord


@dataclass(frozen=True)
class Inventory:
    """What the registry holds, for its gauges."""

    base_models: int
    #: Adapter names with at least one READY version.
    adapters: int
    #: Versions and the bytes of their files, by status.
    versions: dict[VersionStatus, int]
    version_bytes: dict[VersionStatus, int]


class BlobsMissing(Exception):
    """A blob vanished between its write and the READY commit (gc raced us)."""


class Store:
    def __init__(self, db: Database, clock: Callable[[], datetime] = utcnow) -> None:
        self.db = db
        self.clock = clock

    # -- base models ---------------------------------------------------------------------------

    def add_base_model(self, name: str, spec: ModelSpec, by: str) -> tuple[BaseModelRecord, bool]:
        """Stores a base model; (record, created). Same name and fingerprint: not
        created; same name, other fingerprint: AlreadyExists."""

        def work(s: Session) -> tuple[BaseModelRecord, bool]:
            row = s.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
            if row is not None:
                if row.fingerprint != spec.fingerprint:
                    raise AlreadyExists(
                        f"base model {name!r} is registered with fingerprint {row.fingerprint}, "
                        f"not {spec.fingerprint}: register the other checkpoint under a new name"
                    )
                return _base_model(row), False
            row = BaseModelRow(
                name=name,
                model_type=spec.model_type,
                fingerprint=spec.fingerprint,
                hidden_size=spec.hidden_size,
                moe_intermediate_size=spec.moe_intermediate_size,
                num_experts=spec.num_experts,
                top_k=spec.top_k,
                num_layers=spec.num_layers,
                moe_layers=list(spec.moe_layers),
                shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                checkpoint_dtype=spec.checkpoint_dtype,
                config_json=spec.config_json,
                created_at=self.clock(),
                created_by=by,
            )
            s.add(row)
            s.flush()
            return _base_model(row), True

        return self.db.write_retrying(work)

    def get_base_model(self, name: str) -> BaseModelRecord:
        with self.db.read() as s:
            row = s.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
            if row is None:
                raise NotFound(f"base model {name!r} is not registered")
            return _base_model(row)

    def list_base_models(self, after: str | None, limit: int) -> list[BaseModelRecord]:
        with self.db.read() as s:
            query = select(BaseModelRow).order_by(BaseModelRow.name).limit(limit)
            if after is not None:
                query = query.where(BaseModelRow.name > after)
            return [_base_model(row) for row in s.scalars(query)]

    # -- uploads -------------------------------------------------------------------------------

    def begin_upload(self, header: UploadHeader, by: str) -> PendingUpload:
        """Records an upload in progress (an invisible PENDING row)."""

        def work(s: Session) -> PendingUpload:
            base = s.scalar(select(BaseModelRow).where(BaseModelRow.name == header.base_model))
            if base is None:
                raise FailedPrecondition(
                    f"base model {header.base_model!r} is not registered: register it first "
                    "(adapterctl base-model register PATH)"
                )
            adapter = s.scalar(select(AdapterRow).where(AdapterRow.name == header.name))
            now = self.clock()
            if adapter is None:
                adapter = AdapterRow(name=header.name, created_at=now)
                s.add(adapter)
                s.flush()
            row = VersionRow(
                adapter_id=adapter.id,
                version=None,
                status=VersionStatus.PENDING,
                base_model_id=base.id,
                base_model_fingerprint=base.fingerprint,
                description=header.description,
                size_bytes=sum(f.size_bytes for f in header.files),
                created_at=now,
                created_by=by,
                heartbeat_at=now,
                labels=[LabelRow(key=k, value=v) for k, v in sorted(header.labels.items())],
            )
            s.add(row)
            s.flush()
            return PendingUpload(row.id, _base_model(base))

        return self.db.write_retrying(work)

    def heartbeat(self, pending_id: int) -> None:
        with self.db.write() as s:
            s.execute(
                update(VersionRow)
                .where(VersionRow.id == pending_id, VersionRow.status == VersionStatus.PENDING)
                .values(heartbeat_at=self.clock())
            )

    def fail_upload(self, pending_id: int, error: str) -> None:
        with self.db.write() as s:
            s.execute(
                update(VersionRow)
                .where(VersionRow.id == pending_id, VersionRow.status == VersionStatus.PENDING)
                .values(status=VersionStatus.FAILED, error=error[:4000], heartbeat_at=self.clock())
            )

    def complete_upload(
        self,
        pending_id: int,
        summary: AdapterSummary,
        files: Sequence[StoredFile],
        digest: str,
        alias: str | None,
        blobs_present: Callable[[Sequence[str]], bool],
    ) -> VersionInfo:
        """Makes the PENDING row READY with the next version number, points the
        alias at it and records the events, in one transaction. The blob rows
        are claimed (row-locked) first and ``blobs_present`` is asked under that
        lock, so gc cannot remove a blob between the check and the commit;
        BlobsMissing when one is gone."""

        def work(s: Session) -> VersionInfo:
            row = s.get(VersionRow, pending_id)
            if row is None or row.status is not VersionStatus.PENDING:
                raise FailedPrecondition(
                    "the upload was abandoned (gc purged its PENDING record after "
                    "gc_grace_seconds without progress): upload again"
                )
            now = self.clock()
            keys = sorted({f.blob_key for f in files})
            sizes = {f.blob_key: f.info.size_bytes for f in files}
            for key in keys:
                self._claim_blob(s, key, sizes[key], now)
            if not blobs_present(keys):
                raise BlobsMissing(", ".join(keys))
            latest = s.scalar(
                select(func.max(VersionRow.version)).where(VersionRow.adapter_id == row.adapter_id)
            )
            row.version = (latest or 0) + 1
            row.status = VersionStatus.READY
            row.digest = digest
            row.format = summary.format
            row.rank = summary.rank
            row.lora_alpha = summary.lora_alpha
            row.use_rslora = summary.use_rslora
            row.target_parameters = list(summary.target_parameters)
            row.layers = list(summary.layers)
            row.dtype = summary.dtype
            row.size_bytes = sum(f.info.size_bytes for f in files)
            row.ready_at = now
            row.heartbeat_at = now
            row.files = [
                FileRow(
                    path=f.info.path,
                    size_bytes=f.info.size_bytes,
                    sha256=f.info.sha256,
                    part_size_bytes=f.info.part_size_bytes or None,
                    part_sha256=list(f.info.part_sha256) if f.info.part_size_bytes else None,
                    blob_key=f.blob_key,
                )
                for f in files
            ]
            s.flush()
            self._append_event(s, EventType.READY, row)
            if alias:
                self._move_alias(s, row, alias)
            s.flush()
            s.refresh(row)
            return _version_info(row)

        return self.db.write_retrying(work)

    def _claim_blob(self, s: Session, key: str, size: int, now: datetime) -> None:
        insert = pg_insert if self.db.dialect == "postgresql" else sqlite_insert
        stmt = insert(BlobRow).values(key=key, size_bytes=size, claimed_at=now)
        s.execute(stmt.on_conflict_do_update(index_elements=["key"], set_={"claimed_at": now}))

    # -- reads ---------------------------------------------------------------------------------

    def resolve(self, ref: AdapterRef) -> VersionInfo:
        with self.db.read() as s:
            return _version_info(self._resolve(s, ref))

    def resolve_files(self, ref: AdapterRef) -> tuple[VersionInfo, list[StoredFile]]:
        """The version and where each of its files' bytes are, in path order."""
        with self.db.read() as s:
            row = self._resolve(s, ref)
            files = [StoredFile(_file_info(f), f.blob_key) for f in row.files]
            return _version_info(row), files

    def _resolve(self, s: Session, ref: AdapterRef, *, lock: bool = False) -> VersionRow:
        query = select(VersionRow).join(VersionRow.adapter).where(AdapterRow.name == ref.name)
        if ref.version is not None:
            query = query.where(
                VersionRow.version == ref.version, VersionRow.status == VersionStatus.READY
            )
        elif ref.alias is not None:
            query = query.join(AliasRow, AliasRow.version_id == VersionRow.id).where(
                AliasRow.alias == ref.alias
            )
        elif ref.digest is not None:
            # A digest also finds soft-deleted versions; a READY one wins.
            query = query.where(
                VersionRow.digest == ref.digest, VersionRow.status.in_(VISIBLE)
            ).order_by((VersionRow.status == VersionStatus.READY).desc(), VersionRow.version.desc())
        else:
            query = query.where(VersionRow.status == VersionStatus.READY).order_by(
                VersionRow.version.desc()
            )
        if lock:
            query = query.with_for_update(of=VersionRow)
        row = s.scalars(query.limit(1)).first()
        if row is None:
            raise NotFound(self._missing(s, ref))
        return row

    def _missing(self, s: Session, ref: AdapterRef) -> str:
        if s.scalar(select(AdapterRow.id).where(AdapterRow.name == ref.name)) is None:
            return f"no adapter named {ref.name!r}"
        if ref.version is not None:
            return f"adapter {ref.name!r} has no READY version {ref.version}"
        if ref.alias is not None:
            return f"adapter {ref.name!r} has no alias {ref.alias!r}"
        if ref.digest is not None:
            return f"adapter {ref.name!r} has no version with digest {ref.digest}"
        return f"adapter {ref.name!r} has no READY version"

    def list_versions(
        self, flt: ListFilter, after: tuple[str, int] | None, limit: int
    ) -> list[VersionInfo]:
        """Visible versions by name, then version descending, after the key ``after``."""
        statuses = VISIBLE if flt.include_deleted else (VersionStatus.READY,)
        query = (
            select(VersionRow)
            .join(VersionRow.adapter)
            .where(VersionRow.status.in_(statuses))
            .order_by(AdapterRow.name, VersionRow.version.desc())
            .limit(limit)
        )
        if flt.name:
            query = query.where(AdapterRow.name == flt.name)
        if flt.base_model:
            query = query.join(VersionRow.base_model).where(BaseModelRow.name == flt.base_model)
        for key, value in flt.labels.items():
            query = query.where(
                exists().where(
                    LabelRow.version_id == VersionRow.id,
                    LabelRow.key == key,
                    LabelRow.value == value,
                )
            )
        if flt.latest_only:
            other = aliased(VersionRow)
            newest = select(func.max(other.version)).where(
                other.adapter_id == VersionRow.adapter_id, other.status == VersionStatus.READY
            )
            query = query.where(
                VersionRow.status == VersionStatus.READY,
                VersionRow.version == newest.scalar_subquery(),
            )
        if after is not None:
            name, version = after
            query = query.where(
                or_(
                    AdapterRow.name > name,
                    and_(AdapterRow.name == name, VersionRow.version < version),
                )
            )
        with self.db.read() as s:
            return [_version_info(row) for row in s.scalars(query)]

    # -- aliases and deletes -------------------------------------------------------------------

    def set_alias(self, name: str, alias: str, version: int) -> AliasChange:
        def work(s: Session) -> AliasChange:
            row = self._resolve(s, AdapterRef(name, version=version), lock=True)
            previous = self._move_alias(s, row, alias)
            s.flush()
            s.refresh(row)
            return AliasChange(_version_info(row), previous)

        return self.db.write_retrying(work)

    def _move_alias(self, s: Session, row: VersionRow, alias: str) -> int:
        """Points the alias at ``row``; the version it pointed at before (0: new)."""
        current = s.scalar(
            select(AliasRow)
            .where(AliasRow.adapter_id == row.adapter_id, AliasRow.alias == alias)
            .with_for_update()
        )
        now = self.clock()
        if current is None:
            s.add(
                AliasRow(adapter_id=row.adapter_id, alias=alias, version_id=row.id, updated_at=now)
            )
            previous = 0
        else:
            previous = (
                s.scalar(select(VersionRow.version).where(VersionRow.id == current.version_id)) or 0
            )
            if current.version_id == row.id:
                return previous
            current.version_id = row.id
            current.updated_at = now
        s.flush()
        self._append_event(s, EventType.ALIAS_SET, row, alias=alias, previous_version=previous)
        return previous

    def delete_alias(self, name: str, alias: str) -> int:
        def work(s: Session) -> int:
            current = s.scalar(
                select(AliasRow)
                .join(AdapterRow, AdapterRow.id == AliasRow.adapter_id)
                .where(AdapterRow.name == name, AliasRow.alias == alias)
                .with_for_update(of=AliasRow)
            )
            if current is None:
                raise NotFound(f"adapter {name!r} has no alias {alias!r}")
            row = s.get_one(VersionRow, current.version_id)
            s.delete(current)
            s.flush()
            self._append_event(s, EventType.ALIAS_DELETED, row, alias=alias)
            assert row.version is not None
            return row.version

        return self.db.write_retrying(work)

    def delete_version(
        self, ref: AdapterRef, refuse_if_aliased: bool = False
    ) -> tuple[VersionInfo, bool]:
        """Soft-deletes the version ``ref`` pins and removes its aliases (or, with
        ``refuse_if_aliased``, raises FailedPrecondition naming them); (version, changed).
        Deleting by digest what is deleted already changes nothing."""
        if not ref.is_pinned_version:
            raise InvalidArgument(
                f"ref: {str(ref)!r} does not pin a version: delete NAME:VERSION or NAME@sha256:HEX",
                "ref",
            )

        def work(s: Session) -> tuple[VersionInfo, bool]:
            row = self._resolve(s, ref, lock=True)
            if row.status is VersionStatus.DELETED:
                return _version_info(row), False
            aliases = list(
                s.scalars(
                    select(AliasRow).where(AliasRow.version_id == row.id).order_by(AliasRow.alias)
                )
            )
            if aliases and refuse_if_aliased:
                named = ", ".join(f"{row.adapter.name}@{a.alias}" for a in aliases)
                raise FailedPrecondition(
                    f"{row.adapter.name}:{row.version} is what {named} point"
                    f"{'s' if len(aliases) == 1 else ''} at: move "
                    f"{'it' if len(aliases) == 1 else 'them'} first, or delete without "
                    "refuse_if_aliased to remove them with the version",
                    "ref",
                )
            for alias in aliases:
                s.delete(alias)
                s.flush()
                self._append_event(s, EventType.ALIAS_DELETED, row, alias=alias.alias)
            row.status = VersionStatus.DELETED
            row.deleted_at = self.clock()
            s.flush()
            self._append_event(s, EventType.DELETED, row)
            s.refresh(row)
            return _version_info(row), True

        return self.db.write_retrying(work)

    # -- events --------------------------------------------------------------------------------

    def _append_event(
        self,
        s: Session,
        kind: EventType,
        row: VersionRow,
        *,
        alias: str = "",
        previous_version: int = 0,
    ) -> None:
        # The counter row stays locked until commit, so sequences are handed out
        # in commit order.
        sequence = s.execute(
            update(EventCounterRow)
            .where(EventCounterRow.id == 1)
            .values(last_sequence=EventCounterRow.last_sequence + 1)
            .returning(EventCounterRow.last_sequence)
        ).scalar_one()
        assert row.version is not None and row.digest is not None
        s.add(
            EventRow(
                sequence=sequence,
                type=kind,
                name=row.adapter.name,
                base_model=row.base_model.name,
                version=row.version,
                digest=row.digest,
                alias=alias,
                previous_version=previous_version,
                created_at=self.clock(),
            )
        )

    def blob_claimed(self, key: str) -> bool:
        """Whether a blob row exists for ``key`` (a version, or an upload committing one, uses
        it)."""
        with self.db.read() as s:
            return s.scalar(select(BlobRow.key).where(BlobRow.key == key)) is not None

    def server_key(self, name: str) -> bytes:
        """The shared secret ``name`` (see migration 0003)."""
        with self.db.read() as s:
            secret = s.scalar(select(ServerKeyRow.secret).where(ServerKeyRow.name == name))
        if secret is None:
            raise RuntimeError(f"server key {name!r} is missing: is the database migrated?")
        return bytes(secret)

    def inventory(self) -> Inventory:
        """Counts of base models, adapters and versions (and their bytes) by status: one
        aggregate query per figure, whatever the number of rows."""
        with self.db.read() as s:
            base_models = s.scalar(select(func.count()).select_from(BaseModelRow)) or 0
            adapters = (
                s.scalar(
                    select(func.count(func.distinct(VersionRow.adapter_id))).where(
                        VersionRow.status == VersionStatus.READY
                    )
                )
                or 0
            )
            total = func.coalesce(func.sum(VersionRow.size_bytes), 0)
            rows = s.execute(
                select(VersionRow.status, func.count(), total).group_by(VersionRow.status)
            ).all()
        versions = dict.fromkeys(VersionStatus, 0)
        version_bytes = dict.fromkeys(VersionStatus, 0)
        for status, count, size in rows:
            versions[VersionStatus(status)] = int(count)
            version_bytes[VersionStatus(status)] = int(size)
        return Inventory(base_models, adapters, versions, version_bytes)

    def last_sequence(self) -> int:
        with self.db.read() as s:
            return s.scalar(select(EventCounterRow.last_sequence)) or 0

    def oldest_sequence(self) -> int | None:
        """The smallest sequence still kept; None when none is."""
        with self.db.read() as s:
            return s.scalar(select(func.min(EventRow.sequence)))

    def events(self, after: int, upto: int, name: str, base_model: str, limit: int) -> list[Event]:
        """Events with after < sequence <= upto matching the filters, oldest first."""
        query = (
            select(EventRow)
            .where(EventRow.sequence > after, EventRow.sequence <= upto)
            .order_by(EventRow.sequence)
            .limit(limit)
        )
        if name:
            query = query.where(EventRow.name == name)
        if base_model:
            query = query.where(EventRow.base_model == base_model)
        with self.db.read() as s:
            return [
                Event(
                    e.sequence,
                    e.type,
                    e.name,
                    e.version,
                    e.digest,
                    e.alias,
                    e.previous_version,
                    e.created_at,
                    e.base_model,
                )
                for e in s.scalars(query)
            ]


def _base_model(row: BaseModelRow) -> BaseModelRecord:
    spec = spec_from_config(
        json.loads(row.config_json),
        config_json=row.config_json,
        checkpoint_dtype=row.checkpoint_dtype,
        fingerprint=row.fingerprint,
    )
    return BaseModelRecord(row.name, spec, row.created_at, row.created_by)


def _version_info(row: VersionRow) -> VersionInfo:
    assert row.version is not None and row.digest is not None and row.format is not None
    assert row.rank is not None and row.lora_alpha is not None and row.dtype is not None
    return VersionInfo(
        name=row.adapter.name,
        version=row.version,
        digest=row.digest,
        base_model=row.base_model.name,
        base_model_fingerprint=row.base_model_fingerprint,
        status=row.status,
        summary=AdapterSummary(
            format=row.format,
            rank=row.rank,
            lora_alpha=row.lora_alpha,
            use_rslora=bool(row.use_rslora),
            target_parameters=tuple(row.target_parameters or ()),
            layers=tuple(row.layers or ()),
            dtype=row.dtype,
        ),
        size_bytes=row.size_bytes,
        files=tuple(_file_info(f) for f in row.files),
        aliases=tuple(a.alias for a in row.aliases),
        description=row.description,
        labels={label.key: label.value for label in row.labels},
        create_time=row.created_at,
        created_by=row.created_by,
        delete_time=row.deleted_at,
    )


def _file_info(row: FileRow) -> FileInfo:
    # NULL pieces: stored before the registry recorded them.
    return FileInfo(
        row.path,
        row.size_bytes,
        row.sha256,
        row.part_size_bytes or 0,
        tuple(row.part_sha256 or ()),
    )
