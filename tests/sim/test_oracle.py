"""The hindsight bound searches role counts (issue 11), on tuning data only (Mooncake 0-4 min)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from fleetshift_daemon.core.perfmodel import Deployment, PerfModel
from fleetshift_daemon.sim.engine import Role, SimConfig, Simulator
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.metrics import summarize
from fleetshift_daemon.sim.oracle import OraclePolicy, phase_order, role_count_shapes, run_oracle
from fleetshift_daemon.sim.policies import StaticSplit, observed_mix
from fleetshift_daemon.sim.timing import StepTimer
from fleetshift_daemon.sim.trace import load_trace

MOONCAKE = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
) / "mooncake_conversation_trace.jsonl"


def test_every_role_count_along_the_phase_order_is_a_candidate() -> None:
    fleet = standard_fleet(preset="llama31-70b", nodes_per_kind=2)
    trace = load_trace(MOONCAKE).window(0.0, 240.0)
    sim = Simulator(fleet, trace, OraclePolicy(), PerfModel(), SimConfig())
    mix = observed_mix(sim, 0.0, 240.0)
    order = phase_order(sim, mix)
    shapes = role_count_shapes(sim, mix)
    counts = {
        tuple(Counter(roles)[r] for r in (Role.PREFILL, Role.MIXED, Role.DECODE))
        for roles in shapes
    }
    n = len(sim.instances)
    want = {(0, n, 0)}
    for k in range(1, n):
        want |= {(k, 0, n - k), (k, n - k, 0), (0, n - k, k)}
    assert counts == want
    for roles in shapes:  # prefill goes to the most prefill-leaning instances first
        pre = [i for i, r in enumerate(roles) if r is Role.PREFILL]
        assert sorted(pre) == sorted(order[: len(pre)])


def test_the_role_count_bound_is_above_the_four_shapes() -> None:
    # Overloaded long contexts on six instances. Searching role counts and scoring the backlog
    # raises the bound well above the four shapes of earlier rounds. It is still a greedy
    # choice per window, not a true bound: with round 5's performance model it gives 1.11
    # requests/s against the static split's 1.35 (with round 4's it was 1.33 against 1.32),
    # so the split's goodput is reported beside it, never assumed below it.
    fleet = standard_fleet(preset="llama31-70b", nodes_per_kind=2)
    trace = load_trace(MOONCAKE).window(0.0, 240.0)
    model = PerfModel()
    timers: dict[Deployment, StepTimer] = {}
    split = Simulator(fleet, trace, StaticSplit(), model, SimConfig(), timers).run()
    bounds = {}
    for search in (False, True):
        sim = Simulator(fleet, trace, OraclePolicy(), model, SimConfig(), timers)
        bounds[search] = summarize(run_oracle(sim, 60.0, role_search=search), "oracle").goodput_rps
    split_goodput = summarize(split, "split").goodput_rps
    assert bounds[True] >= 1.1 * bounds[False], (bounds, split_goodput)
