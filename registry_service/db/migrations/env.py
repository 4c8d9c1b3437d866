"""Alembic environment: runs revisions on the connection that ``migrate.py``
hands over (there is no alembic.ini; the registry drives Alembic itself)."""

from __future__ import annotations

from alembic import context

from registry_service.db.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
