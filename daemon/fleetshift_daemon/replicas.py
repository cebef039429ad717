"""This daemon's part among replicas: the lease loop and, while it follows, its view refresh.

The state machine is ``core.leadership.Leadership``; the SQL is ``store.lease_store``. Here
they meet the event loop:

- every ``renew_interval_s`` the leader renews (followers try to take an expired lease), on a
  thread of its own with its own database connection, so a saturated event loop cannot make
  it miss its deadline; each attempt is bounded by the time the leader may still act, so a
  database that hangs cannot keep a deposed leader acting: at the deadline it is deposed and
  ``on_deposed`` cancels the executor's operations;
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
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
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
        # Re-reads of the database run one at a time; ``_reads_started`` numbers them as they
        # start and ``_reads_done`` is the number of the last one finished (catch_up's rule).
        self._read_lock = asyncio.Lock()
        self._reads_started = 0
        self._reads_done = 0
        self._lease_stop: threading.Event | None = None
        self._lease_thread_handle: threading.Thread | None = None

    async def run_lease(self) -> None:
        """Drive the lease from a thread of its own and apply its transitions here, in order.

        The renewals and their timing must not share this event loop: a loop saturated by Route
        (or blocked by any long step) woke past its renew deadline and the leader deposed
        itself while the database would gladly have renewed. The thread renews on its own
        connection (``store``'s engine is the lease's alone) and updates the state machine,
        whose deadline every action on this loop checks (``acting``/``token``); only what
        follows a change of role (recovery, cancelling the executor) runs on this loop."""
        loop = asyncio.get_running_loop()
        transitions: asyncio.Queue[Transition] = asyncio.Queue()

        def deliver(transition: Transition) -> None:
            if transition is Transition.NONE:
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to stop
                loop.call_soon_threadsafe(transitions.put_nowait, transition)

        stop = threading.Event()
        thread = threading.Thread(
            target=self._lease_thread, args=(stop, deliver), name="fleetshiftd lease", daemon=True
        )
        self._lease_stop, self._lease_thread_handle = stop, thread
        thread.start()
        try:
            while True:
                await self._apply(await transitions.get())
        finally:
            stop.set()

    def _lease_thread(self, stop: threading.Event, deliver: Callable[[Transition], None]) -> None:
        ld, settings = self._leadership, self._leadership.settings
        # One worker: an attempt that hangs in the database is given up at the deadline (the
        # leader stops acting then) and the next attempt queues behind it.
        calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetshiftd lease db")
        try:
            while not stop.is_set():
                deliver(self._attempt(calls))
                wait = settings.renew_interval_s
                if ld.leading:  # wake at the deadline if the next renewal is late
                    wait = min(wait, max(0.01, ld.time_left()))
                if stop.wait(wait):
                    break
                deliver(ld.check())
        except Exception:  # never die silently: the deadline still stops the leader
            log.exception("lease thread failed; this replica stops leading at its deadline")
        finally:
            calls.shutdown(wait=False, cancel_futures=True)

    def _attempt(self, calls: ThreadPoolExecutor) -> Transition:
        ld, settings = self._leadership, self._leadership.settings
        started = self._monotonic()  # stamped before the call is queued: errs early, never late
        token = ld.tenure_token
        if token is not None:
            call = calls.submit(self._store.renew, ld.identity, token, settings.ttl_s)
            limit = max(0.01, ld.time_left())
        else:
            call = calls.submit(self._store.acquire, ld.identity, ld.address, settings.ttl_s)
            limit = settings.renew_deadline_s
        try:
            view = call.result(timeout=limit)
        except Exception as err:  # any failure is a missed renewal, never the thread's end
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
                await self._read()  # the last leader's final writes
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
                    await self._read()
                except Exception:  # the view stays as it was; the next round tries again
                    log.exception("follower view refresh failed")
            await asyncio.sleep(self._view_refresh_s)

    async def _read(self) -> None:
        async with self._read_lock:
            await self._read_locked()

    async def _read_locked(self) -> None:
        self._reads_started += 1
        number = self._reads_started
        await asyncio.to_thread(self._refresh)
        self._reads_done = number

    @property
    def reads(self) -> int:
        """The number of the last re-read of the database that finished (re-reads are
        numbered as they start, so this counts the failed ones before it too)."""
        return self._reads_done

    async def catch_up(self) -> bool:
        """A follower was asked for something its view lacks (Route for a served model with no
        worker): re-read the database before answering no. Returns whether it re-read.

        The view trails the leader's writes by up to ``view_refresh_s``, and a caller may
        act on a write the leader has already acknowledged (StartWorker returned, then Route
        reaches this replica): without this, Route answered NOT_FOUND for that gap. Only a
        re-read that *started after this call arrived* can have seen such a write, so the
        call waits for one; calls arriving while a re-read runs share the next, which bounds
        the database work to one re-read at a time however many calls miss."""
        if self._leadership.leading:
            return False  # the leader's view is where its own writes land first
        arrived_after = self._reads_started
        async with self._read_lock:
            if self._reads_done > arrived_after:
                return True  # one that started after this call arrived has finished
            try:
                await self._read_locked()
            except SQLAlchemyError:
                log.exception("follower view catch-up failed")
                return False
        return True

    async def release(self) -> None:
        """A graceful stop hands the lease over at once (the lease thread stops first, or it
        could take the released lease back: ``acquire`` lets the holder re-take it)."""
        if self._lease_stop is not None and self._lease_thread_handle is not None:
            self._lease_stop.set()
            await asyncio.to_thread(
                self._lease_thread_handle.join, self._leadership.settings.renew_deadline_s
            )
        token = self._leadership.tenure_token
        if token is None:
            return
        with contextlib.suppress(SQLAlchemyError):
            await asyncio.to_thread(self._store.release, self._leadership.identity, token)
