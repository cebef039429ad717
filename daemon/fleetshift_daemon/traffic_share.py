"""Daemon replicas share their Route arrivals, so the leader plans on the whole fleet's traffic.

Route feeds the traffic window of the replica that answers it; with clients balancing over
three replicas the leader's planner saw about a third of the arrivals (docs/replicas.md). Worker
counters need no sharing (agents heartbeat every replica); Route observations do:

- a **follower** publishes, every ``interval_s``, the arrivals its window gained since its last
  publication (one row per model, ``store/traffic_store.py``);
- the **leader** reads the rows it has not seen from the other replicas and merges them into
  its window at their own times (``TrafficMonitor.observe_requests_at``). On election it reads
  back over the whole window, so a new leader starts with the fleet's recent traffic; and it
  purges rows no window covers any more (a fenced write).

A leader does not publish: its window holds the others' arrivals too, and nobody reads them
while it leads. What the old leader alone answered is therefore missing from a new leader's
window until the window has turned over (``traffic.window_s``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.traffic import TrafficMonitor
from fleetshift_daemon.store.traffic_store import Arrival, SqlArrivalStore

log = logging.getLogger("fleetshift.daemon.replicas")

PURGE_EVERY = 30  # rounds: old rows cost nothing until then
PURGE_MARGIN_S = 60.0
# After its first read (the whole window), the leader looks back this far each round and
# skips the rows it has taken in: a row whose insert commits later than this after it began
# is missed.
LOOKBACK_S = 10.0


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
        self._published_to: float | None = None  # arrivals up to this time are out
        self._taken: dict[int, float] | None = None  # row id -> when; None: not leading
        self._rounds = 0
        self.published = 0  # arrivals this replica published / took in (tests, benches)
        self.taken_in = 0

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.step)
            except (SQLAlchemyError, Deposed) as err:
                log.warning("sharing route arrivals failed: %s", err)
            await asyncio.sleep(self.interval_s)

    def step(self) -> None:
        """One round, blocking: publish (follower) or take in (leader)."""
        if self._leading():
            self._published_to = None
            self._take_in()
        else:
            self._taken = None
            self._publish()

    def _publish(self) -> None:
        now = self._clock()
        since = self._published_to
        if since is None:
            self._published_to = now
            return  # just started following: what the window holds came from elsewhere too
        fresh: dict[str, list[Arrival]] = {}
        for model in self._traffic.models():
            new = self._traffic.requests_since(model, since)
            fresh[model] = [(now - t, p, o) for t, p, o in new if t <= now]
        self._store.publish(self._identity, fresh)  # a failure publishes them next round
        self._published_to = now
        self.published += sum(len(a) for a in fresh.values())

    def _take_in(self) -> None:
        window = self._traffic.config.window_s
        now = self._clock()
        if self._taken is None:  # just elected: read back over the whole window
            self._taken, look_back = {}, window
        else:
            look_back = LOOKBACK_S
            self._taken = {i: t for i, t in self._taken.items() if now - t < 2 * LOOKBACK_S}
        for row in self._store.since(self._identity, look_back, self._taken.keys()):
            at = now - row.age_s
            self.taken_in += self._traffic.observe_requests_at(
                row.model, ((at - age, p, o) for age, p, o in row.arrivals if math.isfinite(age))
            )
            self._taken[row.id] = now
        self._rounds += 1
        if self._rounds % PURGE_EVERY == 0:
            self._store.purge(window + PURGE_MARGIN_S)
