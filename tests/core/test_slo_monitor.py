"""The measured-SLO monitor and what the planning cycle does with it."""

from __future__ import annotations

import numpy as np
import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.burst import BurstConfig, fluid_capacity, phase_need
from fleetshift_daemon.core.planner import SloTarget
from fleetshift_daemon.core.slo_monitor import (
    LatencySample,
    SloMonitor,
    SloMonitorConfig,
    SloThresholds,
    share_within,
)

from ..clock import ManualClock

SLO = SloThresholds(ttft_ms=1000.0, tbt_ms=100.0)


def _report(worker: str, ttft_p99: float, tbt_p99: float = 50.0, queue: int = 0) -> LatencySample:
    return LatencySample(worker, "m", ttft_p99 / 3, ttft_p99, tbt_p99 / 2, tbt_p99, queue, 8)


def test_share_within_reads_a_lognormal_through_the_two_percentiles() -> None:
    assert share_within(100.0, 400.0, 400.0) == pytest.approx(0.99, abs=1e-6)
    assert share_within(100.0, 400.0, 100.0) == pytest.approx(0.5, abs=1e-6)
    assert share_within(0.0, 0.0, 10.0) == 1.0  # nothing measured is not a miss


def test_measured_misses_put_the_slo_at_risk_even_when_the_model_is_happy() -> None:
    clock = ManualClock()
    mon = SloMonitor(clock)
    mon.observe([_report("a", 500.0), _report("b", 600.0)])
    ok = mon.assess("m", SLO)
    assert not ok.at_risk and ok.attainment is not None and ok.attainment > 0.99
    clock.advance(10)
    mon.observe([_report("a", 5000.0), _report("b", 600.0)])  # one worker's TTFT p99 5x over
    bad = mon.assess("m", SLO)
    assert bad.at_risk and bad.prefill_short and not bad.decode_short
    assert bad.current is not None and bad.current < 0.99
    assert "at risk" in bad.reason


def test_growing_queues_are_a_risk_before_any_latency_misses() -> None:
    clock = ManualClock()
    mon = SloMonitor(clock)
    for q in (10, 20, 40, 80):
        mon.observe([_report("a", 300.0, queue=q)])
        clock.advance(10)
    a = mon.assess("m", SLO)
    assert a.at_risk and a.queue_growing and a.prefill_short


def test_retiring_needs_margin_held_for_the_whole_hold_without_a_break() -> None:
    clock = ManualClock()
    mon = SloMonitor(clock, SloMonitorConfig(retire_hold_s=600.0))
    for _ in range(30):
        mon.observe([_report("a", 300.0)])
        assert not mon.assess("m", SLO).retire_ok
        clock.advance(10)
    mon.observe([_report("a", 5000.0)])  # one bad round resets the margin
    assert not mon.assess("m", SLO).retire_ok
    for _ in range(61):
        clock.advance(10)
        mon.observe([_report("a", 300.0)])
        last = mon.assess("m", SLO)
    assert last.retire_ok and "retiring allowed" in last.reason


def test_bad_reports_are_refused_and_change_nothing() -> None:
    mon = SloMonitor(ManualClock())
    with pytest.raises(InvalidArgument, match="ttft_p99_ms"):
        mon.observe([LatencySample("a", "m", 1.0, float("nan"))])
    assert mon.assess("m", SLO).attainment is None
    with pytest.raises(InvalidArgument, match="target"):
        SloMonitorConfig(target=1.5)


def test_fluid_capacity_covers_a_burst_shorter_than_a_restart_but_not_a_longer_one() -> None:
    work = np.full(300, 100.0)
    work[100:130] = 1000.0  # a 30 s burst at 10x
    mean = work.mean()
    short = fluid_capacity(work, 1.0, delay_s=1.0, max_run_s=120.0)
    assert short > 8 * 100.0  # the burst must be carried almost at its height
    assert fluid_capacity(work, 1.0, delay_s=1.0, max_run_s=1.0) < short
    assert fluid_capacity(np.full(300, 100.0), 1.0, 1.0, 120.0) == pytest.approx(100.0, rel=0.02)
    assert short >= mean


def test_phase_need_is_in_requests_so_a_mix_shift_is_not_a_burst() -> None:
    rng = np.random.default_rng(0)
    times = np.sort(rng.uniform(0, 300, 1500))
    need = phase_need(
        (times, np.full(1500, 3000.0), np.full(1500, 50.0)),
        300.0,
        300.0,
        SloTarget(2000, 100),
        120.0,
        BurstConfig(),
    )
    # 5 req/s Poisson: the standing need is a small multiple of the rate, whatever the sizes
    assert 5.0 <= need.prefill_rps < 15.0 and 5.0 <= need.decode_rps < 15.0
