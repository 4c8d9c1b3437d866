"""Server keys: secrets every replica of a registry shares because they share its database; the
first signs page tokens (so that a client cannot forge the key a listing resumes after).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    keys = op.create_table(
        "server_keys",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
    )
    op.bulk_insert(keys, [{"name": "page_tokens", "secret": secrets.token_bytes(32)}])


def downgrade() -> None:
    op.drop_table("server_keys")
