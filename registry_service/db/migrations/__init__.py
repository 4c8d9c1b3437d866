"""Alembic environment and revisions of the registry schema."""
