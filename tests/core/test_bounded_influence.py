"""No single observation moves the traffic mix or the output estimate beyond what a request
could physically be (issue 13 item 1): the guards at the entry of the traffic window and the
output-length estimator."""

from __future__ import annotations

import pytest

from fleetshift_daemon.core.estimator import OutputLengthEstimator
from fleetshift_daemon.core.traffic import (
    MAX_TOKENS_PER_S_PER_WORKER,
    TrafficMonitor,
    bounded_observation,
)

from ..clock import ManualClock

CONTEXT = 4096


def test_an_observation_is_clipped_to_the_context_or_ignored() -> None:
    assert bounded_observation(100, 300.0, CONTEXT) == (100, 300.0)
    assert bounded_observation(4000, 1e18, CONTEXT) == (4000, 96.0)
    assert bounded_observation(CONTEXT + 1, 10.0, CONTEXT) is None


def test_one_huge_claim_moves_the_window_mean_by_at_most_context_over_n() -> None:
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock)
    mon.set_context_limits({"m": CONTEXT})
    for _ in range(99):
        mon.observe_request("m", 500, 200.0)
    mon.observe_request("m", 10**15, 10**15)  # beyond the context: not counted at all
    mon.observe_request("m", 96, 1e300)  # counted, output clipped to 4000
    s = mon.stats("m")
    assert s.requests == 100
    assert s.output.mean == pytest.approx((99 * 200 + 4000) / 100)
    assert s.output.mean - 200 <= CONTEXT / 100


def test_an_implausible_counter_jump_is_not_demand() -> None:
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock)
    mon.observe_counters("w1", "m", 1_000, 1_000)
    clock.t += 1.0
    mon.observe_counters("w1", "m", 1_000 + 2**53, 2_000)  # one heartbeat, 9e15 tokens
    clock.t += 1.0
    mon.observe_request("m", 100, 10)  # the model has a window
    s = mon.stats("m")
    assert s.source == "requests"  # the jump left no counter sample behind
    clock.t += 1.0
    mon.observe_counters("w1", "m", 1_000 + 2**53 + 50_000, 2_500)
    s = mon.stats("m")
    assert s.source == "counters"
    assert s.prefill_tokens_per_s < MAX_TOKENS_PER_S_PER_WORKER


def test_the_estimator_learns_nothing_impossible() -> None:
    est = OutputLengthEstimator()
    est.set_context_limits({"m": CONTEXT})
    for _ in range(30):
        est.observe_completion("m", 600, 100)
    est.observe_completion("m", 600, 10**15)  # clipped to 3496
    est.observe_completion("m", 10**9, 10)  # beyond the context: ignored
    assert est.estimate("m", 600) == pytest.approx((30 * 100 + 3496) / 31)
