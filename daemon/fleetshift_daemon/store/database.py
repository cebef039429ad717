"""Database engines and schema upgrades.

The daemon upgrades its schema at every start. Two replicas may start at once (PostgreSQL
deployments run several), so the upgrade runs under a lock: a PostgreSQL advisory lock, or an
exclusive file lock beside the SQLite file. The second replica waits, then finds the schema at
head and does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url

import fleetshift_migrations

MIGRATIONS_DIR = Path(fleetshift_migrations.__file__).parent
ADVISORY_LOCK_KEY = 0x464C5348  # "FLSH"


def normalise_url(url: str) -> str:
    """Use psycopg 3 for PostgreSQL whatever dialect prefix the operator wrote."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, pool: int = 5) -> Engine:
    """``pool``: PostgreSQL connections kept (as many again may overflow); the lease thread
    takes an engine of its own with ``pool=1``."""
    url = normalise_url(url)
    if url.startswith("sqlite"):
        path = make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=pool, max_overflow=pool)


def _sqlite_pragmas(dbapi_conn: object, _record: object) -> None:
    cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision``; safe when several daemons start at once."""
    with _migration_lock(engine) as conn:
        command.upgrade(alembic_config(conn), revision)
        conn.commit()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[Connection]:
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": ADVISORY_LOCK_KEY})
            conn.commit()
            try:
                yield conn
            finally:
                conn.rollback()
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": ADVISORY_LOCK_KEY})
                conn.commit()
        return
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:":
        with engine.connect() as conn:
            yield conn
        return
    lock_path = Path(f"{database}.migrate.lock")
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            with engine.connect() as conn:
                yield conn
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
