"""The measured-SLO monitor and what the planning cycle does with it."""

from __future__ import annotations

import numpy as np
import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_common.vocabulary import Role
from fleetshift_daemon.core.burst import BurstConfig, fluid_capacity, phase_need
from fleetshift_daemon.core.fleet import WorkerCounters
from fleetshift_daemon.core.planner import SloTarget
from fleetshift_daemon.core.slo_monitor import (
    KV_BLOCK_TOKENS,
    LatencySample,
    SloMonitor,
    SloMonitorConfig,
    SloThresholds,
    sample_from_counters,
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


def _heartbeat(
    worker: str, role: Role, queue: int, kv_used: int, ttft_p99: float, tbt_p99: float = 50.0
) -> LatencySample:
    """A worker's counters as its heartbeat carries them (KV in blocks of 16 tokens)."""
    counters = WorkerCounters(
        worker,
        queue_depth=queue,
        kv_blocks_used=kv_used,
        kv_blocks_total=1000,
        live_sessions=8 + queue,
        ttft_p50_ms=ttft_p99 / 3,
        ttft_p99_ms=ttft_p99,
        tbt_p50_ms=tbt_p99 / 2,
        tbt_p99_ms=tbt_p99,
    )
    return sample_from_counters(counters, "m", role)


def test_hand_offs_waiting_for_decode_memory_read_as_a_decode_shortage() -> None:
    # A split fleet whose decode worker is out of KV: hand-offs queue on it, the prompts they
    # came from hold the prefill worker's KV, so its prompt queue grows and TTFT misses. That
    # is a decode shortage; before the queue was split by side, it read as a prefill one.
    clock = ManualClock()
    mon = SloMonitor(clock)
    for q in (4, 8, 16, 32):
        mon.observe(
            [
                _heartbeat("p", Role.PREFILL, queue=q, kv_used=990, ttft_p99=5000.0),
                _heartbeat("d", Role.DECODE, queue=q // 2, kv_used=995, ttft_p99=0.0),
            ]
        )
        clock.advance(10)
    a = mon.assess("m", SLO)
    assert a.at_risk and a.memory_bound and a.decode_queue_growing
    assert a.decode_short and not a.prefill_short
    assert not a.prefill_queue_growing


def test_prompts_queued_with_memory_free_read_as_a_prefill_shortage() -> None:
    clock = ManualClock()
    mon = SloMonitor(clock)
    for q in (4, 8, 16, 32):
        mon.observe(
            [
                _heartbeat("p", Role.PREFILL, queue=q, kv_used=200, ttft_p99=5000.0),
                _heartbeat("d", Role.DECODE, queue=0, kv_used=500, ttft_p99=0.0),
            ]
        )
        clock.advance(10)
    a = mon.assess("m", SLO)
    assert a.at_risk and a.prefill_queue_growing and a.prefill_short
    assert not a.decode_short and not a.memory_bound


def test_a_colocated_worker_out_of_kv_is_short_of_both_phases() -> None:
    # A mixed worker's prompts wait behind its own running decodes: more of either phase
    # alone would not do, so both are reported short (a new mixed worker brings both).
    clock = ManualClock()
    mon = SloMonitor(clock)
    for q in (4, 8, 16, 32):
        mon.observe([_heartbeat("m", Role.MIXED, queue=q, kv_used=995, ttft_p99=5000.0)])
        clock.advance(10)
    a = mon.assess("m", SLO)
    assert a.memory_bound and not a.handoff_blocked
    assert a.prefill_short and a.decode_short


def test_counters_convert_blocks_to_tokens_and_keep_the_role() -> None:
    s = _heartbeat("d", Role.DECODE, queue=3, kv_used=950, ttft_p99=0.0)
    assert (s.kv_used_tokens, s.kv_total_tokens) == (950 * KV_BLOCK_TOKENS, 1000 * KV_BLOCK_TOKENS)
    assert s.role is Role.DECODE and s.queue_depth == 3 and s.decode_side(0.9)
    assert not _heartbeat("p", Role.PREFILL, 3, 100, 10.0).decode_side(0.9)
    with pytest.raises(InvalidArgument) as err:
        SloMonitorConfig(kv_full_fraction=0.0)
    assert err.value.field == "kv_full_fraction"


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


def _staggered(mon: SloMonitor, clock: ManualClock, rounds: list[list[LatencySample]]) -> None:
    """Each worker's report on its own node's heartbeat, one second apart per node and the
    nodes spread over the second, as the daemon receives them (not all at one instant)."""
    for k, reports in enumerate(rounds):
        for i, report in enumerate(reports):
            clock.t = k + i / len(reports)
            mon.observe([report])


def test_staggered_heartbeats_make_one_round_of_the_whole_model_per_interval() -> None:
    # Four nodes, one worker each, queues rising together 1, 2, 3, 4, 5 an interval: the
    # model's queue grew fivefold. Read a heartbeat at a time (a round per clock reading),
    # the last four "rounds" were four heartbeats of one interval, 17 -> 20: not growing.
    # (a heartbeat a second, under the default 2 s round: a node's next report closes it)
    clock = ManualClock()
    mon = SloMonitor(clock)
    workers = ("a", "b", "c", "d")
    _staggered(mon, clock, [[_report(w, 300.0, queue=k + 1) for w in workers] for k in range(5)])
    a = mon.assess("m", SLO)
    assert a.queue_growing and a.prefill_queue_growing and a.at_risk


def test_a_pools_margin_is_the_whole_pools_at_each_round_not_one_nodes() -> None:
    # Two prefill workers on two nodes: one with 1 session at ~98.5% within the TTFT SLO,
    # one with 9 sessions at ~100%: the pool meets 99% (99.85%). Reading each heartbeat as a
    # round judged the slow node alone in every other round and never let the pool give.
    def prefill(worker: str, ttft_p99: float, sessions: int) -> LatencySample:
        return LatencySample(worker, "m", 300.0, ttft_p99, 0.0, 0.0, 0, sessions, role=Role.PREFILL)

    assert 0.98 < share_within(300.0, 1090.0, SLO.ttft_ms) < 0.99
    clock = ManualClock()
    mon = SloMonitor(clock)
    pool = [prefill("slow", 1090.0, 1), prefill("fast", 400.0, 9)]
    _staggered(mon, clock, [pool] * 6)
    assert mon.pool_held("m", Role.PREFILL, SLO, since=0.5)


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
