"""SQL side of sharing Route arrivals between daemon replicas (``traffic_share.py``).

Each replica answers a share of the Route calls and records them in its own traffic window; the
leader's planner must see all of them, and so must a follower that becomes leader. Every
replica publishes what it answered itself, one row per model per interval, numbered so a retry
never lands twice; every replica reads the rows of the others it has not seen yet. Times
travel as ages counted back from the row's ``created_at``, stamped by the database's own clock
(as the lease's expiry is), so two replicas' clocks are never compared.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker
from sqlalchemy.sql import ColumnElement

from fleetshift_daemon.store.lease_store import Fence, check_fence, database_now
from fleetshift_daemon.store.models import RouteArrivalRow

Arrival = tuple[float, int, float]  # (age_s or time, prompt tokens, output tokens)


@dataclass(frozen=True)
class PublishedArrivals:
    id: int
    replica: str
    model: str
    age_s: float  # how long ago, on the database's clock, the row was written
    arrivals: tuple[Arrival, ...]  # each (age before the row was written, prompt, output)


class SqlArrivalStore:
    def __init__(self, engine: Engine, fence: Fence | None = None) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence  # the leader's: purging is its decision

    def _now(self) -> ColumnElement[Any]:
        return database_now(self._engine)

    def publish(self, replica: str, batch: int, by_model: Mapping[str, Sequence[Arrival]]) -> bool:
        """Publication number ``batch`` of ``replica``: one row per model, ``(age_s, prompt,
        output)`` with ages counted back from now. Idempotent: every row of a publication goes
        in one transaction, so when the unique ``(replica, batch, model)`` refuses one, that
        publication landed whole before (a retry after a failure reported past its commit),
        and nothing is written twice. Returns whether this call wrote it.
        Not fenced: like a registration, it is a statement of what this replica saw."""
        rows = [
            {
                "replica": replica,
                "batch": batch,
                "model": model,
                "created_at": self._now(),
                "payload": [[round(a, 4), p, o] for a, p, o in arrivals],
            }
            for model, arrivals in by_model.items()
            if arrivals
        ]
        if not rows:
            return False
        try:
            with self._sessions.begin() as session:
                for row in rows:
                    session.add(RouteArrivalRow(**row))
        except IntegrityError:
            if not self._landed(replica, batch):
                raise
            return False
        return True

    def _landed(self, replica: str, batch: int) -> bool:
        row = RouteArrivalRow
        with self._sessions() as session:
            found = session.execute(
                select(row.id).where(row.replica == replica, row.batch == batch).limit(1)
            ).first()
        return found is not None

    def since(
        self, other_than: str, max_age_s: float, skip: Collection[int] = ()
    ) -> list[PublishedArrivals]:
        """Rows at most ``max_age_s`` old from every replica but ``other_than``, except the
        ids in ``skip`` (already taken in), oldest first. By age rather than after the last
        id: ids are handed out when a transaction inserts, so a smaller one can commit after
        a larger one has been read."""
        row = RouteArrivalRow
        with self._sessions() as session:
            now = session.execute(select(self._now())).scalar_one()
            query = select(row.id, row.replica, row.model, row.created_at, row.payload).where(
                row.replica != other_than,
                row.created_at > now - timedelta(seconds=max_age_s),
            )
            if skip:
                query = query.where(row.id.notin_(list(skip)))
            found = session.execute(query.order_by(row.id)).all()
        return [
            PublishedArrivals(
                r.id,
                r.replica,
                r.model,
                max(0.0, (_aware(now) - _aware(r.created_at)).total_seconds()),
                tuple((float(a), int(p), float(o)) for a, p, o in r.payload),
            )
            for r in found
        ]

    def purge(self, older_than_s: float) -> int:
        """Drop rows no traffic window still covers (the leader's job: fenced)."""
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            now = session.execute(select(self._now())).scalar_one()
            done = session.execute(
                delete(RouteArrivalRow).where(
                    RouteArrivalRow.created_at < now - timedelta(seconds=older_than_s)
                )
            )
            return int(done.rowcount or 0)  # type: ignore[attr-defined]


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
