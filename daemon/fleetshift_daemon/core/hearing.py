"""The liveness clock: wall time minus the time the daemon could not hear its fleet.

A node turns lost when the daemon has not heard it for ``node_lost_after_s``. But heartbeats
are heard on the daemon's event loop: while that loop is stalled (a saturated host, a long
collection, a starved thread) heartbeats wait unread or time out at the agents, and every node
looks silent for as long as the stall lasted, through no fault of its own
(tests/test_paused_daemon.py pauses a real daemon with SIGSTOP for twice the timeout). It does
not see an overload that queues heartbeats inside gRPC while the loop keeps turning: under the
load bench that kind lost nodes with or without this clock (docs/benchmarks.md).

A ticker on the loop calls ``tick`` every ``tick_s``; how much later than that it runs, beyond
``tolerance_s``, is time the daemon was deaf, and this clock does not advance through it. A
stall still in progress counts too (the time since the last tick beyond the same allowance),
so a sweep that runs before the ticker has caught up already sees it. Liveness is judged on
this clock; the times shown to operators stay on the wall clock. The price: a daemon that is
deaf most of the time judges slowly, never falsely.

Stalls are timed on a monotonic clock of their own, not on the daemon's (injected) clock: a
test's manual clock jumping forward is time passing, not the loop stalling.
"""

from __future__ import annotations

import time
from collections.abc import Callable

TICK_S = 0.1
TOLERANCE_S = 0.05  # lateness below this is an ordinary busy loop, not deafness


class HearingClock:
    def __init__(
        self,
        clock: Callable[[], float],
        tick_s: float = TICK_S,
        tolerance_s: float = TOLERANCE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._monotonic = monotonic
        self._allowance = tick_s + tolerance_s
        self._deaf_s = 0.0  # stalls already ended, in seconds
        self._last_tick: float | None = None

    def tick(self) -> None:
        """The loop ran the ticker now: a stall since the last tick has ended."""
        now = self._monotonic()
        self._deaf_s += self._stall(now)
        self._last_tick = now

    @property
    def deaf_s(self) -> float:
        """Seconds the loop was deaf so far, the stall in progress included."""
        return self._deaf_s + self._stall(self._monotonic())

    def __call__(self) -> float:
        return self._clock() - self.deaf_s

    def _stall(self, now: float) -> float:
        if self._last_tick is None:
            return 0.0
        return max(0.0, now - self._last_tick - self._allowance)
