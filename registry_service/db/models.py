"""The SQL schema (SQLAlchemy 2 typed ORM). Alembic migrations in ``migrations/``
create exactly these tables; change both together.

Rows of ``adapter_versions`` are immutable once READY except for the move to
DELETED. ``version`` is NULL while PENDING or FAILED: numbers are handed out
when a version becomes READY, so READY versions of a name count 1, 2, 3 ...
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from registry_service.domain import EventType, VersionStatus


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every database (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _enum(cls: type[enum.Enum], name: str) -> Enum:
    # Stored as plain strings (no PostgreSQL ENUM type), so adding a member is
    # a code change, not a migration.
    return Enum(cls, name=name, native_enum=False, length=16, validate_strings=True)


class Base(DeclarativeBase):
    # Named constraints, so that later migrations (SQLite batch mode included)
    # can refer to them.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
        }
    )
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime}


class BaseModelRow(Base):
    """A registered base model: its MoE shape and fingerprint."""

    __tablename__ = "base_models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    model_type: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(String(71))
    hidden_size: Mapped[int] = mapped_column(Integer)
    moe_intermediate_size: Mapped[int] = mapped_column(Integer)
    num_experts: Mapped[int] = mapped_column(Integer)
    top_k: Mapped[int] = mapped_column(Integer)
    num_layers: Mapped[int] = mapped_column(Integer)
    moe_layers: Mapped[list[int]] = mapped_column(JSON)
    shared_expert_intermediate_size: Mapped[int] = mapped_column(Integer)
    checkpoint_dtype: Mapped[str] = mapped_column(String(32))
    config_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(128))


class AdapterRow(Base):
    """An adapter name; its versions hold everything else."""

    __tablename__ = "adapters"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime]


class VersionRow(Base):
    """One upload of an adapter and what validation learned about it."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version"),
        Index(None, "digest"),
        Index(None, "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id"))
    version: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[VersionStatus] = mapped_column(_enum(VersionStatus, "version_status"))
    base_model_id: Mapped[int] = mapped_column(ForeignKey("base_models.id"))
    base_model_fingerprint: Mapped[str] = mapped_column(String(71))
    digest: Mapped[str | None] = mapped_column(String(71))
    format: Mapped[str | None] = mapped_column(String(16))
    rank: Mapped[int | None] = mapped_column(Integer)
    lora_alpha: Mapped[float | None] = mapped_column(Float)
    use_rslora: Mapped[bool | None] = mapped_column(Boolean)
    target_parameters: Mapped[list[str] | None] = mapped_column(JSON)
    layers: Mapped[list[int] | None] = mapped_column(JSON)
    dtype: Mapped[str | None] = mapped_column(String(16))
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    description: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(128))
    # Uploads in progress refresh this; gc treats PENDING rows whose heartbeat is
    # older than the grace period as abandoned (server killed mid-upload).
    heartbeat_at: Mapped[datetime]
    ready_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)

    adapter: Mapped[AdapterRow] = relationship(lazy="joined", innerjoin=True)
    base_model: Mapped[BaseModelRow] = relationship(lazy="joined", innerjoin=True)
    files: Mapped[list[FileRow]] = relationship(
        lazy="selectin", order_by="FileRow.path", cascade="all, delete-orphan"
    )
    labels: Mapped[list[LabelRow]] = relationship(
        lazy="selectin", order_by="LabelRow.key", cascade="all, delete-orphan"
    )
    aliases: Mapped[list[AliasRow]] = relationship(
        lazy="selectin", order_by="AliasRow.alias", viewonly=True
    )


class FileRow(Base):
    """One file of a READY or DELETED version and the blob holding its bytes."""

    __tablename__ = "adapter_files"
    __table_args__ = (UniqueConstraint("version_id", "path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("adapter_versions.id", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    # The sha256 of each part_size_bytes piece, in order (lower-case hex); NULL for files
    # stored before the registry recorded pieces (`moelora-registry backfill-parts`).
    part_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    part_sha256: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    # The foreign key keeps gc from removing a blob row that a file points at.
    blob_key: Mapped[str] = mapped_column(ForeignKey("blobs.key"), index=True)


class LabelRow(Base):
    """One label of a version (a table, so that list filters stay plain SQL)."""

    __tablename__ = "adapter_labels"
    __table_args__ = (
        UniqueConstraint("version_id", "key"),
        Index(None, "key", "value"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("adapter_versions.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(63))
    value: Mapped[str] = mapped_column(String(256))


class AliasRow(Base):
    """``name@alias`` pointing at a READY version."""

    __tablename__ = "aliases"
    __table_args__ = (UniqueConstraint("adapter_id", "alias"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id"))
    alias: Mapped[str] = mapped_column(String(64))
    version_id: Mapped[int] = mapped_column(ForeignKey("adapter_versions.id"), index=True)
    updated_at: Mapped[datetime]


class BlobRow(Base):
    """A content-addressed object in the blob store.

    ``claimed_at`` is the last time an upload said it is about to use the blob;
    gc removes a blob only when no file row points at it and the claim is older
    than the grace period (see gc.py for the locking that makes this safe)."""

    __tablename__ = "blobs"

    key: Mapped[str] = mapped_column(String(80), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    claimed_at: Mapped[datetime]


class EventRow(Base):
    """A change event for WatchAdapters. Sequence numbers come from
    ``event_counter`` under its row lock, so they are handed out in commit
    order: a reader that saw sequence N has seen every event below N."""

    __tablename__ = "events"

    sequence: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    type: Mapped[EventType] = mapped_column(_enum(EventType, "event_type"))
    name: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(71))
    alias: Mapped[str] = mapped_column(String(64), default="")
    previous_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(index=True)


class EventCounterRow(Base):
    """Exactly one row: the last sequence handed out."""

    __tablename__ = "event_counter"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_sequence: Mapped[int] = mapped_column(BigInteger)


class ServerKeyRow(Base):
    """A secret the replicas share through the database (made by the migration that adds it)."""

    __tablename__ = "server_keys"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    secret: Mapped[bytes] = mapped_column(LargeBinary)
