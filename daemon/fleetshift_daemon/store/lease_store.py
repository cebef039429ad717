"""SQL side of leadership: the lease row and the fencing check every executor write makes.

Expiry is judged by the database's clock (``now()`` on PostgreSQL), so replicas on different
hosts never compare their own clocks. Each statement is one short transaction:

- ``acquire``: take the lease when it has expired (or this replica held it), token + 1;
- ``renew``: extend it, only while this replica holds it under the same token;
- ``take``: SQLite only, where one daemon owns the file (a file lock proves it): always taken;
- ``release``: a graceful stop hands the lease over at once instead of after the TTL.

``check_fence`` runs inside a writer's own transaction: it reads the lease row ``FOR SHARE``,
so a concurrent takeover (an UPDATE of that row) waits for the write to commit, and a write
whose token is no longer the row's is refused and rolled back with it. That is how the
database refuses a deposed leader's writes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, literal, select, update
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import ColumnElement

from fleetshift_daemon.core.leadership import Deposed, LeaseView
from fleetshift_daemon.store.models import LeaderLeaseRow

LEASE_ID = 1
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)

# The fencing token a writer must carry, or None when this process must not write.
Fence = Callable[[], int | None]


class SqlLeaseStore:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def _now(self, plus_s: float = 0.0) -> ColumnElement[Any]:
        return database_now(self._engine, plus_s)

    def acquire(self, identity: str, address: str, ttl_s: float) -> LeaseView:
        """Take the lease if it has expired (or this replica was its holder): a new token."""
        now = self._now()
        row = LeaderLeaseRow
        with self._sessions.begin() as session:
            taken = session.execute(
                update(row)
                .where(row.id == LEASE_ID, (row.expires_at <= now) | (row.holder == identity))
                .values(
                    holder=identity,
                    address=address,
                    token=row.token + 1,
                    expires_at=self._now(ttl_s),
                    renewed_at=now,
                )
                .returning(row.token)
            ).scalar_one_or_none()
            if taken is not None:
                return LeaseView(identity, address, int(taken), held_by_me=True)
            return _view(session, identity)

    def renew(self, identity: str, token: int, ttl_s: float) -> LeaseView:
        """Extend the lease this replica holds under ``token``; refused once it has expired."""
        now = self._now()
        row = LeaderLeaseRow
        with self._sessions.begin() as session:
            kept = session.execute(
                update(row)
                .where(
                    row.id == LEASE_ID,
                    row.holder == identity,
                    row.token == token,
                    row.expires_at > now,
                )
                .values(expires_at=self._now(ttl_s), renewed_at=now)
                .returning(row.address)
            ).scalar_one_or_none()
            if kept is not None:
                return LeaseView(identity, kept, token, held_by_me=True)
            return _view(session, identity)

    def take(self, identity: str, address: str) -> LeaseView:
        """The sole owner of an SQLite database leads unconditionally (a new token)."""
        row = LeaderLeaseRow
        with self._sessions.begin() as session:
            token = session.execute(
                update(row)
                .where(row.id == LEASE_ID)
                .values(
                    holder=identity,
                    address=address,
                    token=row.token + 1,
                    expires_at=FAR_FUTURE,
                    renewed_at=self._now(),
                )
                .returning(row.token)
            ).scalar_one()
            return LeaseView(identity, address, int(token), held_by_me=True)

    def release(self, identity: str, token: int) -> bool:
        """Let the lease expire now, so a follower takes over without waiting out the TTL."""
        row = LeaderLeaseRow
        with self._sessions.begin() as session:
            result = session.execute(
                update(row)
                .where(row.id == LEASE_ID, row.holder == identity, row.token == token)
                .values(expires_at=self._now())
                .returning(row.id)
            )
            return result.scalar_one_or_none() is not None

    def current(self, identity: str = "") -> LeaseView:
        with self._sessions() as session:
            return _view(session, identity)


def database_now(engine: Engine, plus_s: float = 0.0) -> ColumnElement[Any]:
    """The database's clock (PostgreSQL), plus ``plus_s``; SQLite, whose one daemon has no
    one to disagree with, gets this process's clock."""
    if engine.dialect.name == "postgresql":
        return func.now() + timedelta(seconds=plus_s)
    moment = datetime.now(UTC) + timedelta(seconds=plus_s)
    return literal(moment, LeaderLeaseRow.__table__.c.expires_at.type)


def _view(session: Session, identity: str) -> LeaseView:
    row = session.get(LeaderLeaseRow, LEASE_ID, populate_existing=True)
    assert row is not None, "the leader_lease row is created by migration 0004"
    return LeaseView(row.holder, row.address, int(row.token), held_by_me=False)


def check_fence(session: Session, fence: Fence | None) -> None:
    """Refuse (raise ``Deposed``, rolling the caller's transaction back) unless ``fence``'s
    token is the lease's current one; holds a share lock on the lease row until commit."""
    if fence is None:
        return
    token = fence()
    if token is None:
        raise Deposed("this daemon does not lead: write refused", field="leadership")
    current = session.execute(
        select(LeaderLeaseRow.token).where(LeaderLeaseRow.id == LEASE_ID).with_for_update(read=True)
    ).scalar_one()
    if current != token:
        raise Deposed(
            f"fencing token {token} is stale (the lease is at token {current}): another "
            "daemon leads; write refused",
            field="leadership",
        )
