"""Initial schema: base models, adapters, versions, files, labels, aliases, blobs,
events and the event counter (seeded with its single row).

Revision ID: 0001
Revises: none
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("name", name=op.f("uq_adapters_name")),
    )
    op.create_table(
        "base_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("model_type", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=71), nullable=False),
        sa.Column("hidden_size", sa.Integer(), nullable=False),
        sa.Column("moe_intermediate_size", sa.Integer(), nullable=False),
        sa.Column("num_experts", sa.Integer(), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("moe_layers", sa.JSON(), nullable=False),
        sa.Column("shared_expert_intermediate_size", sa.Integer(), nullable=False),
        sa.Column("checkpoint_dtype", sa.String(length=32), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_base_models")),
        sa.UniqueConstraint("name", name=op.f("uq_base_models_name")),
    )
    op.create_table(
        "blobs",
        sa.Column("key", sa.String(length=80), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_blobs")),
    )
    op.create_table(
        "event_counter",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("last_sequence", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_event_counter")),
    )
    counter = sa.table(
        "event_counter", sa.column("id", sa.Integer), sa.column("last_sequence", sa.BigInteger)
    )
    op.bulk_insert(counter, [{"id": 1, "last_sequence": 0}])
    op.create_table(
        "events",
        sa.Column("sequence", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column(
            "type",
            sa.Enum(
                "READY",
                "DELETED",
                "ALIAS_SET",
                "ALIAS_DELETED",
                name="event_type",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("base_model", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("previous_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sequence", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_created_at"), "events", ["created_at"])
    op.create_index(op.f("ix_events_name"), "events", ["name"])

    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column(
            "status",
            sa.Enum(
                "PENDING",
                "READY",
                "FAILED",
                "DELETED",
                name="version_status",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("base_model_id", sa.Integer(), nullable=False),
        sa.Column("base_model_fingerprint", sa.String(length=71), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=True),
        sa.Column("format", sa.String(length=16), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("lora_alpha", sa.Float(), nullable=True),
        sa.Column("use_rslora", sa.Boolean(), nullable=True),
        sa.Column("target_parameters", sa.JSON(), nullable=True),
        sa.Column("layers", sa.JSON(), nullable=True),
        sa.Column("dtype", sa.String(length=16), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_adapter_versions_adapter_id_adapters")
        ),
        sa.ForeignKeyConstraint(
            ["base_model_id"],
            ["base_models.id"],
            name=op.f("fk_adapter_versions_base_model_id_base_models"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_versions")),
        sa.UniqueConstraint(
            "adapter_id", "version", name=op.f("uq_adapter_versions_adapter_id_version")
        ),
    )
    op.create_index(op.f("ix_adapter_versions_digest"), "adapter_versions", ["digest"])
    op.create_index(op.f("ix_adapter_versions_status"), "adapter_versions", ["status"])

    op.create_table(
        "adapter_files",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=255), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("blob_key", sa.String(length=80), nullable=False),
        sa.ForeignKeyConstraint(
            ["blob_key"], ["blobs.key"], name=op.f("fk_adapter_files_blob_key_blobs")
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["adapter_versions.id"],
            name=op.f("fk_adapter_files_version_id_adapter_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_files")),
        sa.UniqueConstraint("version_id", "path", name=op.f("uq_adapter_files_version_id_path")),
    )
    op.create_index(op.f("ix_adapter_files_blob_key"), "adapter_files", ["blob_key"])

    op.create_table(
        "adapter_labels",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=63), nullable=False),
        sa.Column("value", sa.String(length=256), nullable=False),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["adapter_versions.id"],
            name=op.f("fk_adapter_labels_version_id_adapter_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_labels")),
        sa.UniqueConstraint("version_id", "key", name=op.f("uq_adapter_labels_version_id_key")),
    )
    op.create_index(op.f("ix_adapter_labels_key_value"), "adapter_labels", ["key", "value"])

    op.create_table(
        "aliases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_aliases_adapter_id_adapters")
        ),
        sa.ForeignKeyConstraint(
            ["version_id"],
            ["adapter_versions.id"],
            name=op.f("fk_aliases_version_id_adapter_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_aliases")),
        sa.UniqueConstraint("adapter_id", "alias", name=op.f("uq_aliases_adapter_id_alias")),
    )
    op.create_index(op.f("ix_aliases_version_id"), "aliases", ["version_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_aliases_version_id"), table_name="aliases")

    op.drop_table("aliases")
    op.drop_index(op.f("ix_adapter_labels_key_value"), table_name="adapter_labels")

    op.drop_table("adapter_labels")
    op.drop_index(op.f("ix_adapter_files_blob_key"), table_name="adapter_files")

    op.drop_table("adapter_files")
    op.drop_index(op.f("ix_adapter_versions_status"), table_name="adapter_versions")
    op.drop_index(op.f("ix_adapter_versions_digest"), table_name="adapter_versions")

    op.drop_table("adapter_versions")
    op.drop_index(op.f("ix_events_name"), table_name="events")
    op.drop_index(op.f("ix_events_created_at"), table_name="events")

    op.drop_table("events")
    op.drop_table("event_counter")
    op.drop_table("blobs")
    op.drop_table("base_models")
    op.drop_table("adapters")
