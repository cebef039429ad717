from __future__ import annotations

import pytest

from fleetshift_daemon.core.gpus import H100_SXM, H200_SXM
from fleetshift_daemon.core.perfmodel import Dtype, PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.planning_cycle import PlanningCycle, demand_from_traffic
from fleetshift_daemon.core.plans import Hysteresis, HysteresisConfig, MoveKind
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.traffic import TrafficMonitor

from ..clock import ManualClock

M70 = "llama2-70b"


def test_traffic_to_efficiency_to_a_proposed_plan_after_the_hold_time() -> None:
    clock = ManualClock()
    monitor = TrafficMonitor(clock)
    for _ in range(3000):  # decode-heavy: 100 requests/s of 200 in, 1500 out
        monitor.observe_request(M70, 200, 1500)
        clock.t += 0.01
    demand = demand_from_traffic(monitor, [M70, "idle-model"])
    assert demand[0].arrival_rate_per_s == pytest.approx(100, rel=0.02)
    assert demand[1].arrival_rate_per_s == 0
    nodes = [NodeCapacity("h100-0", H100_SXM, 8), NodeCapacity("h200-0", H200_SXM, 8)]
    inp = planning_input(
        nodes,
        [ModelSpec(llama2_70b(), tp_options=(2, 4))],
        demand[:1],
        default_slo=SloTarget(2000, 100),
    )
    # Wrong way round: the H200s prefill, the H100s decode.
    current = Placement(
        tuple(
            PlacedWorker(M70, Role.PREFILL, "H200-SXM", 2, dt, "h200-0", f"p{i}", 0, 0)
            for i, dt in enumerate([Dtype.BF16] * 4)
        )
        + tuple(
            PlacedWorker(M70, Role.DECODE, "H100-SXM", 2, Dtype.BF16, "h100-0", f"d{i}", 10, 20_000)
            for i in range(4)
        )
    )
    perf = PerfModel()
    cycle = PlanningCycle(
        Planner(perf), perf, Hysteresis(clock, HysteresisConfig(threshold=0.1, hold_s=300))
    )
    first = cycle.run(inp, current)
    assert first.efficiency < 0.9
    assert not first.decision.propose and "holding" in first.decision.reason
    dry = cycle.dry_run(inp, current)
    assert [m.kind for m in dry.plan.moves] == [m.kind for m in first.plan.moves]
    assert MoveKind.ROLE_CHANGE in {m.kind for m in dry.plan.moves}
    assert not dry.decision.propose and "holding" in dry.decision.reason
    clock.t += 301
    later = cycle.run(inp, current)
    assert later.decision.propose
    assert later.plan.gain_tokens_per_s > 0
