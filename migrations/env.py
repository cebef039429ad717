"""Alembic environment: runs on the connection the daemon hands over (under its migration
lock), or on ``sqlalchemy.url`` when Alembic's own CLI is used."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from fleetshift_daemon.store.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        run(conn)
