"""Per-piece sha256s of each file: adapter_files.part_size_bytes and part_sha256,
NULL for the files stored before (`moelora-registry backfill-parts` fills them in).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Batch mode: SQLite alters tables by copying them where plain ALTER cannot (env.py turns
    # it on for SQLite only); nullable columns need no default for the existing rows.
    with op.batch_alter_table("adapter_files") as batch:
        batch.add_column(sa.Column("part_size_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("part_sha256", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_files") as batch:
        batch.drop_column("part_sha256")
        batch.drop_column("part_size_bytes")
