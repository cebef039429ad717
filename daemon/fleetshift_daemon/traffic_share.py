"""Daemon replicas share their Route arrivals, so every replica's traffic window, the leader's
and a future leader's alike, holds the whole fleet's arrivals, each exactly once.

Route feeds the traffic window of the replica that answers it; with clients balancing over
three replicas each replica sees about a third of the arrivals (docs/replicas.md). Worker
counters need no sharing (agents heartbeat every replica); Route observations do. Every
``interval_s``, **every replica, whatever its role**:

- **publishes** the arrivals it answered itself since its last publication
  (``TrafficMonitor.take_own_arrivals``: Route's own observations, never what it merged from
  others), one row per model, under a publication number of its own
  (``store/traffic_store.py``). A publication that fails is retried with the same number
  until it lands; the database refuses a second copy of a number, so a retry after a failure
  reported past its commit writes nothing;
- **takes in** the rows of every other replica it has not taken yet, at their own times
  (``TrafficMonitor.observe_requests_at``); the first round reads back over the whole window.

Exactly once, on every replica R: an arrival R answered is in R's window from the Route call
and is never read back (R skips its own rows); an arrival another process X answered is in
X's rows exactly once (each is handed out of X's monitor once, and its publication lands
once), and R takes each row once (by id). Roles play no part, so a change of leader changes
nothing here: the new leader's window already holds what the old leader published, up to its
last publication. A restarted process is a new identity with an empty window, so it reads its
former self's rows like anyone else's.

At a graceful stop a replica publishes what is left (``flush``), so only a SIGKILL loses the
calls of a replica's last interval. The leader also purges rows no window covers any more (a
fenced write).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import threading
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.traffic import TrafficMonitor
from fleetshift_daemon.store.traffic_store import PublishedArrivals, SqlArrivalStore

log = logging.getLogger("fleetshift.daemon.replicas")

PURGE_EVERY = 30  # rounds: old rows cost nothing until then
PURGE_MARGIN_S = 60.0
# After its first read (the whole window), a replica looks back this far each round and
# skips the rows it has taken in: a row whose insert commits later than this after it began
# is missed.
LOOKBACK_S = 10.0

Timed = tuple[float, int, float]  # (time on this process's clock, prompt, output)


class TrafficShare:
    def __init__(
        self,
        traffic: TrafficMonitor,
        store: SqlArrivalStore,
        identity: str,
        leading: Callable[[], bool],
        clock: Callable[[], float],
        interval_s: float = 1.0,
    ) -> None:
        self._traffic = traffic
        self._store = store
        self._identity = identity
        self._leading = leading
        self._clock = clock
        self.interval_s = interval_s
        traffic.keep_own_arrivals()  # from here on, what Route answers here is kept to publish
        self._batch = 0  # the last publication number handed out
        self._pending: dict[str, list[Timed]] | None = None  # publication self._batch, not out
        self._taken: dict[int, float] | None = None  # row id -> when; None: nothing read yet
        self._rounds = 0
        self._publishing = threading.Lock()
        self.published = 0  # arrivals this replica published / took in (tests, benches)
        self.taken_in = 0

    def flush(self) -> None:
        """Blocking: publish what is left, at a graceful stop, so the other replicas count
        the calls this one answered in its last interval (a SIGKILL loses them)."""
        self._publish()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.step)
            except (SQLAlchemyError, Deposed) as err:
                log.warning("sharing route arrivals failed: %s", err)
            await asyncio.sleep(self.interval_s)

    def step(self) -> None:
        """One round, blocking: publish what this replica answered, take in the others'."""
        try:
            self._publish()
        finally:  # a database that refuses the insert may still answer the read
            self._take_in()
            self._rounds += 1
            if self._rounds % PURGE_EVERY == 0 and self._leading():
                self._store.purge(self._traffic.config.window_s + PURGE_MARGIN_S)

    def _publish(self) -> None:
        with self._publishing:  # a stop's flush and a round cut short by it, one at a time
            self._publish_locked()

    def _publish_locked(self) -> None:
        """The publication a failed round left, if any, then what was answered since. One
        publication a round otherwise: the calls Route answers while one is being written wait
        for the next round (fs-17g: taking them at once too wrote a second, tiny row and
        transaction nearly every round under load, `bench/arrival_share.py`)."""
        if self._pending is not None:
            self._send_pending()
        own = self._traffic.take_own_arrivals()
        if not own:
            return
        fresh: dict[str, list[Timed]] = {}
        for model, t, p, o in own:
            fresh.setdefault(model, []).append((t, p, o))
        self._batch += 1
        self._pending = fresh
        self._send_pending()

    def _send_pending(self) -> None:
        assert self._pending is not None
        now = self._clock()  # ages as of this attempt: a retry still places them right
        ages = {
            model: [(max(0.0, now - t), p, o) for t, p, o in arrivals]
            for model, arrivals in self._pending.items()
        }
        self._store.publish(self._identity, self._batch, ages)  # raises: retried next round
        self.published += sum(len(a) for a in ages.values())
        self._pending = None

    def _take_in(self) -> None:
        window = self._traffic.config.window_s
        now = self._clock()
        if self._taken is None:  # first round: read back over the whole window
            taken: dict[int, float] = {}
            look_back = window
        else:
            taken = {i: t for i, t in self._taken.items() if now - t < 2 * LOOKBACK_S}
            look_back = LOOKBACK_S
        rows = self._store.since(self._identity, look_back, taken.keys())
        for row in self._worth_merging(rows):
            at = now - row.age_s
            self.taken_in += self._traffic.observe_requests_at(
                row.model, ((at - age, p, o) for age, p, o in row.arrivals if math.isfinite(age))
            )
        for row in rows:
            taken[row.id] = now
        self._taken = taken

    def _worth_merging(self, rows: list[PublishedArrivals]) -> list[PublishedArrivals]:
        """``rows`` less those whose every arrival is older than a model's newest
        ``max_requests`` in ``rows``: the window keeps only its newest ``max_requests`` a
        model, so merging them is work thrown away (the window ends the same). It matters on a
        first round, which reads back over the whole window: at 2,000 Route/s a full window is
        600,000 arrivals, 2.5 s of CPU to keep 50,000 (fs-17g, ``bench/arrival_share.py``)."""
        cap = self._traffic.config.max_requests
        by_model: dict[str, list[PublishedArrivals]] = {}
        for row in rows:
            by_model.setdefault(row.model, []).append(row)
        skip: set[int] = set()
        for model_rows in by_model.values():
            if sum(len(r.arrivals) for r in model_rows) <= cap:
                continue
            ages = (r.age_s + a for r in model_rows for a, _, _ in r.arrivals if math.isfinite(a))
            edge = max(heapq.nsmallest(cap, ages))  # the oldest arrival the window keeps
            skip.update(
                r.id
                for r in model_rows
                if min((r.age_s + a for a, _, _ in r.arrivals), default=math.inf) > edge
            )
        return [r for r in rows if r.id not in skip]
