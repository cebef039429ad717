"""The SLO monitor keeps its reports as rows of numbers (fs-17h), not one object per report.

Two things must hold. The monitor decides exactly as the per-object monitor did: the same
reports, clock readings, forgotten workers and questions give the same assessments, to the
bit, and the same pool answers (``slo_monitor_reference.py`` is that monitor, verbatim). And
what the collector walks no longer grows with the reports kept: a full window of 1,000 nodes
held ~600,000 objects, each visited by every full collection of the daemon's GC.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetshift_common.vocabulary import Role
from fleetshift_daemon.core import slo_monitor as rows
from fleetshift_daemon.core.fleet import WorkerCounters

from ..clock import ManualClock
from . import slo_monitor_reference as ref

WORKERS = [f"w{i}" for i in range(6)]
SLOS = [(1000.0, 100.0), (300.0, 40.0), (50.0, 5.0)]


def _report() -> st.SearchStrategy[tuple[Any, ...]]:
    latency = st.sampled_from([0.0, 5.0, 20.0, 60.0, 150.0, 400.0, 1200.0, 3000.0])
    return st.tuples(
        st.sampled_from(WORKERS),
        st.sampled_from(["m", "m2"]),
        latency,
        latency,
        latency,
        latency,
        st.integers(0, 60),  # queue depth
        st.integers(0, 20),  # live sessions
        st.sampled_from(list(Role)),
        st.integers(0, 1000),  # KV blocks used, of 1,000 (or of 0: not reported)
        st.sampled_from([0, 1000]),
    )


_OP = st.one_of(
    st.tuples(st.just("observe"), st.lists(_report(), max_size=5)),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.3, 1.0, 2.0, 2.5, 7.0, 40.0])),
    st.tuples(st.just("forget"), st.sampled_from(WORKERS)),
    st.tuples(
        st.just("assess"), st.sampled_from(["m", "m2"]), st.sampled_from(SLOS), st.booleans()
    ),
    st.tuples(
        st.just("pool_held"),
        st.sampled_from(["m", "m2"]),
        st.sampled_from([Role.PREFILL, Role.DECODE]),
        st.sampled_from(SLOS),
        st.sampled_from([-1.0, 3.0, 10.0]),
    ),
)


def _sample(module: Any, r: tuple[Any, ...]) -> Any:
    worker, model, t50, t99, d50, d99, queue, live, role, used, total = r
    counters = WorkerCounters(
        worker,
        queue_depth=queue,
        kv_blocks_used=used,
        kv_blocks_total=total,
        live_sessions=live,
        ttft_p50_ms=t50,
        ttft_p99_ms=t99,
        tbt_p50_ms=d50,
        tbt_p99_ms=d99,
    )
    return module.sample_from_counters(counters, model, role)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(_OP, max_size=60),
    window_s=st.sampled_from([0.0, 12.0, 30.0]),
    growth_rounds=st.sampled_from([1, 2, 3]),
)
def test_rows_decide_exactly_as_the_per_report_objects_did(
    ops: list[tuple[Any, ...]], window_s: float, growth_rounds: int
) -> None:
    clock = ManualClock()
    cfg = dict(window_s=window_s, round_s=2.0, retire_hold_s=5.0, queue_growth_rounds=growth_rounds)
    new = rows.SloMonitor(clock, rows.SloMonitorConfig(**cfg))
    old = ref.SloMonitor(clock, ref.SloMonitorConfig(**cfg))
    answers = 0
    for op in ops:
        if op[0] == "observe":
            new.observe([_sample(rows, r) for r in op[1]])
            old.observe([_sample(ref, r) for r in op[1]])
        elif op[0] == "advance":
            clock.advance(op[1])
        elif op[0] == "forget":
            new.forget_worker(op[1])
            old.forget_worker(op[1])
        elif op[0] == "assess":
            _, model, slo, record = op
            got = new.assess(model, rows.SloThresholds(*slo), record=record)
            want = old.assess(model, ref.SloThresholds(*slo), record=record)
            assert dataclasses.astuple(got) == dataclasses.astuple(want), op
            answers += 1
        else:
            _, model, role, slo, since = op
            got_held = new.pool_held(model, role, rows.SloThresholds(*slo), since)
            assert got_held == old.pool_held(model, role, ref.SloThresholds(*slo), since), op


def test_a_loaded_window_is_assessed_the_same_and_every_figure_moves() -> None:
    """A fixed fleet over a full window: the same figures from both, and the figures are not
    the trivial ones (risk, growth, memory-bound, spare capacity all reached)."""
    clock = ManualClock()
    cfg = dict(window_s=20.0, round_s=1.0, retire_hold_s=3.0)
    new = rows.SloMonitor(clock, rows.SloMonitorConfig(**cfg))
    old = ref.SloMonitor(clock, ref.SloMonitorConfig(**cfg))
    seen: set[tuple[bool, ...]] = set()
    for t in range(60):
        batch = [
            (
                f"w{w}",
                "m",
                30.0 + t,
                90.0 + 10 * t * (w % 3),
                8.0,
                20.0 + t,
                (t * w) % 7 + t // 10,
                8,
                [Role.PREFILL, Role.DECODE, Role.MIXED][w % 3],
                (50 * t + 97 * w) % 1001,
                1000,
            )
            for w in range(9)
        ]
        for node in range(3):  # three nodes' heartbeats, staggered over the second
            clock.t = t + node / 3
            new.observe([_sample(rows, r) for r in batch[node * 3 : node * 3 + 3]])
            old.observe([_sample(ref, r) for r in batch[node * 3 : node * 3 + 3]])
        got = new.assess("m", rows.SloThresholds(300.0, 60.0))
        want = old.assess("m", ref.SloThresholds(300.0, 60.0))
        assert dataclasses.astuple(got) == dataclasses.astuple(want)
        seen.add((got.at_risk, got.queue_growing, got.memory_bound, got.prefill_spare > 0))
    assert {f for s in seen for f in range(4) if s[f]} == {0, 1, 2, 3}


def _tracked_from(root: object) -> int:
    """GC-tracked objects reachable from ``root`` (what a full collection visits for it), up
    to classes and modules (shared with the rest of the program)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or not gc.is_tracked(o) or isinstance(o, type | ModuleType):
            continue
        seen.add(id(o))
        stack.extend(gc.get_referents(o))
    return len(seen)


def _fill(module: Any, nodes: int, seconds: int) -> Any:
    clock = ManualClock()
    mon = module.SloMonitor(clock, module.SloMonitorConfig(round_s=1.0))

    def heartbeat(n: int) -> Iterator[Any]:
        for w in range(2):
            yield module.LatencySample(f"n{n}-w{w}", "m", 200.0, 600.0, 20.0, 60.0, n % 5, 8)

    for k in range(seconds):
        for n in range(nodes):
            clock.t = k + n / nodes
            mon.observe(heartbeat(n))
    return mon


def test_the_objects_held_do_not_grow_with_the_reports_kept() -> None:
    """The monitor's state (read inside: what memory holds). 200 nodes of 2 workers at 1 Hz: 30 s and then 60 s of reports double the
    reports kept (12,000 -> 24,000) and, per object, the objects too; with rows, the objects
    grow by a few per round, not per report."""
    old_30, old_60 = (_tracked_from(_fill(ref, 200, s)._models) for s in (30, 60))
    new_30, new_60 = (_tracked_from(_fill(rows, 200, s)._models) for s in (30, 60))
    assert old_60 - old_30 >= 12_000  # one object per report, at least
    assert new_60 - new_30 <= 30 * 4  # a handful per round
    assert new_60 < 2_000  # the worker table (one dict, one list) and the rounds
