"""A fresh PostgreSQL database for one bench run, dropped afterwards (even on failure).

The local server (trust auth) of the development machines and CI; ``FLEETSHIFT_TEST_PG`` names
another admin URL. ``failover``, ``route_replicas`` and ``load_heartbeats_routes`` still
carry their own copy of this, woven into their rounds' clean-up (noted for a clean-up).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import psycopg

PG_ADMIN = os.environ.get("FLEETSHIFT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def scratch_database(prefix: str = "fleetshift_bench", admin_url: str = PG_ADMIN) -> Iterator[str]:
    """Yields the new database's URL (``postgresql://``, as the daemon's config takes it)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
