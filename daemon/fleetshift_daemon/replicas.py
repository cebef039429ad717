"""This daemon's part among replicas: the lease loop and, while it follows, its view refresh.

The state machine is ``core.leadership.Leadership``; the SQL is ``store.lease_store``. Here
they meet the event loop:

- every ``renew_interval_s`` the leader renews (followers try to take an expired lease); each
  attempt is bounded by the time the leader may still act, so a database that hangs cannot
  keep a deposed leader acting: at the deadline it is deposed and ``on_deposed`` cancels the
  executor's operations;
- while it follows, the daemon re-reads the registry, the worker table and the operation log
  every ``view_refresh_s`` (heartbeats reach every replica directly, so only what the leader
  decides comes through the database);
- ``on_elected`` runs once per tenure, after a last refresh: the new leader recovers every
  running operation by the restart rule and starts acting.

SQLite has one daemon (a file lock proves it, see ``sole_owner_lock``): it takes the lease at
start and never runs this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from fleetshift_common.config import ConfigError
from fleetshift_daemon.core.leadership import Leadership, Transition
from fleetshift_daemon.store.lease_store import SqlLeaseStore

log = logging.getLogger("fleetshift.daemon.replicas")


def replica_identity() -> str:
    """Unique per process start: a restarted daemon is a new candidate, never its old self."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def sole_owner_lock(engine: Engine) -> IO[str] | None:
    """SQLite: hold an exclusive lock beside the database file for this process's life (the
    kernel drops it when the process dies, even by SIGKILL). A second daemon is refused."""
    database = engine.url.database
    if not database or database == ":memory:":
        return None
    path = Path(f"{database}.leader.lock")
    handle = open(path, "a+")  # noqa: SIM115 - held until the daemon stops
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"another daemon ({holder}) already runs on the SQLite database {database}; "
            "SQLite serves one daemon. Several daemons need a shared PostgreSQL database "
            "(database_url = 'postgresql://...'), see docs/replicas.md",
            field="database_url",
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


@dataclass
class ReplicaTimes:
    """Monotonic instants of this replica's last changes of role (observability, benches)."""

    elected_at: float | None = None
    deposed_at: float | None = None
    elections: int = 0


class ReplicaLoop:
    def __init__(
        self,
        leadership: Leadership,
        store: SqlLeaseStore,
        refresh: Callable[[], None],
        on_elected: Callable[[], Awaitable[None]],
        on_deposed: Callable[[], Awaitable[None]],
        view_refresh_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._leadership = leadership
        self._store = store
        self._refresh = refresh
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._view_refresh_s = view_refresh_s
        self._monotonic = monotonic
        self.times = ReplicaTimes()

    async def run_lease(self) -> None:
        settings = self._leadership.settings
        while True:
            await self._apply(await self._attempt())
            wait = settings.renew_interval_s
            if self._leadership.leading:  # wake at the deadline if the next renewal is late
                wait = min(wait, max(0.01, self._leadership.time_left()))
            await asyncio.sleep(wait)
            await self._apply(self._leadership.check())

    async def _attempt(self) -> Transition:
        ld, settings = self._leadership, self._leadership.settings
        started = self._monotonic()
        token = ld.tenure_token
        try:
            if token is not None:
                call = asyncio.to_thread(self._store.renew, ld.identity, token, settings.ttl_s)
                limit = max(0.01, ld.time_left())
            else:
                call = asyncio.to_thread(
                    self._store.acquire, ld.identity, ld.address, settings.ttl_s
                )
                limit = settings.renew_deadline_s
            view = await asyncio.wait_for(call, limit)
        except (TimeoutError, SQLAlchemyError, OSError) as err:
            log.warning("lease attempt failed: %s", err or type(err).__name__)
            return ld.failed()
        return ld.observed(view, started)

    async def _apply(self, transition: Transition) -> None:
        ld = self._leadership
        if transition is Transition.ELECTED:
            self.times.elected_at = self._monotonic()
            self.times.elections += 1
            log.warning(
                "leadership: elected", extra={"token": ld.tenure_token, "replica": ld.identity}
            )
            try:
                await asyncio.to_thread(self._refresh)  # the last leader's final writes
            except SQLAlchemyError:
                log.exception("leadership: could not read the database after election")
            await self._on_elected()
        elif transition is Transition.DEPOSED:
            self.times.deposed_at = self._monotonic()
            log.error(
                "leadership: deposed (lease not renewed in time, or taken over); stopping "
                "every action",
                extra={"replica": ld.identity, "leader": ld.leader_address},
            )
            await self._on_deposed()

    async def run_refresh(self) -> None:
        """While this replica follows, keep its view in step with the database."""
        while True:
            if not self._leadership.leading:
                try:
                    await asyncio.to_thread(self._refresh)
                except Exception:  # the view stays as it was; the next round tries again
                    log.exception("follower view refresh failed")
            await asyncio.sleep(self._view_refresh_s)

    async def release(self) -> None:
        """A graceful stop hands the lease over at once."""
        token = self._leadership.tenure_token
        if token is None:
            return
        with contextlib.suppress(SQLAlchemyError):
            await asyncio.to_thread(self._store.release, self._leadership.identity, token)
