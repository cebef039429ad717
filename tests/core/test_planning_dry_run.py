"""The operator's dry run is the periodic pass, committed nowhere.

``fleetshift plan`` (Planning/PlanRebalance) used to plan the window's mean demand while the
periodic pass sized for bursts, gated and closed the measured loop: on bursty traffic the
operator was shown another plan than the one the daemon then ran.
"""

from __future__ import annotations

from fleetshift_daemon.core.burst import BurstSizer
from fleetshift_daemon.core.gpus import H100_SXM, H200_SXM
from fleetshift_daemon.core.perfmodel import Dtype, PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    PlanningInput,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.planning_cycle import CycleReport, PlanningCycle, demand_from_traffic
from fleetshift_daemon.core.plans import Hysteresis, HysteresisConfig
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.slo_monitor import LatencySample, SloMonitor
from fleetshift_daemon.core.traffic import TrafficMonitor

from ..clock import ManualClock

M70 = "llama2-70b"
NODES = [NodeCapacity(f"h100-{i}", H100_SXM, 8) for i in range(2)] + [
    NodeCapacity(f"h200-{i}", H200_SXM, 8) for i in range(2)
]
CURRENT = Placement((PlacedWorker(M70, Role.MIXED, "H100-SXM", 8, Dtype.BF16, "h100-0", "w0"),))


class Daemon:
    """The planning side of a daemon: traffic, burst sizer, SLO monitor, gate, one cycle."""

    def __init__(self, clock: ManualClock, *, bursts: bool = True, first: int = 40) -> None:
        self.clock = clock
        self.traffic = TrafficMonitor(clock)
        # five bursts of 40 requests (the first of ``first``) within a second or so, 30 s
        # apart: ~1.3 requests/s on average
        start = clock()
        sizes = [first, 40, 40, 40, 40]
        self.traffic.observe_requests_at(
            M70,
            [
                (start + 30.0 * b + i / 40, 2000, 200.0)
                for b, n in enumerate(sizes)
                for i in range(n)
            ],
        )
        clock.advance(150.0)
        self.monitor = SloMonitor(clock)
        self.monitor.observe([LatencySample("w0", M70, 300.0, 900.0, 20.0, 40.0, 0, 8)])
        perf = PerfModel()
        gate = Hysteresis(clock, HysteresisConfig(threshold=0.05, hold_s=300.0, min_hold_s=300.0))
        self.cycle = PlanningCycle(
            Planner(perf),
            perf,
            gate,
            clock=clock,
            traffic=self.traffic if bursts else None,
            burst=BurstSizer(clock) if bursts else None,
            slo_monitor=self.monitor,
        )

    def inp(self) -> PlanningInput:
        return planning_input(
            NODES,
            [ModelSpec(llama2_70b(), tp_options=(8,))],
            demand_from_traffic(self.traffic, [M70]),
            default_slo=SloTarget(2000, 100),
        )

    def dry_run(self) -> CycleReport:
        return self.cycle.dry_run(self.inp(), CURRENT)

    def run(self) -> CycleReport:
        return self.cycle.run(self.inp(), CURRENT)


def _verdict(r: CycleReport) -> tuple[object, ...]:
    """What a pass decides: its moves, the gate's verdict and clock, the measured margin."""
    margins = {n: (a.retire_ok, a.margin_since) for n, a in r.measured.items()}
    return (r.plan.moves, r.decision, r.efficiency, margins)


def test_on_bursty_traffic_the_dry_run_names_the_steps_the_next_pass_takes() -> None:
    daemon = Daemon(ManualClock(10_000.0))
    dry = daemon.dry_run()
    done = daemon.run()
    assert dry.plan.moves and dry.plan.moves == done.plan.moves
    assert dry.decision == done.decision  # the same verdict, and the same reason
    # the bug: a plan for the window's mean demand asks for less than the pass sizes for
    mean = Daemon(ManualClock(10_000.0), bursts=False).dry_run()
    assert len(mean.plan.moves) < len(done.plan.moves)


def test_dry_runs_change_nothing_a_later_pass_decides() -> None:
    # the first burst, three times the others, has left the 5-minute traffic window by the
    # first pass: only an operator's dry runs, before any pass ran, saw it
    asked = Daemon(ManualClock(10_000.0), first=120)
    alone = Daemon(ManualClock(10_000.0), first=120)
    asked.dry_run()
    asked.dry_run()
    passes = []
    for _ in range(3):  # passes 10 s apart, the later bursts still in the traffic window
        asked.clock.advance(160.0 if not passes else 10.0)
        alone.clock.advance(160.0 if not passes else 10.0)
        seen, unseen = asked.run(), alone.run()
        assert _verdict(seen) == _verdict(unseen)
        passes.append(seen)
    # the clocks (the gate's, the measured margin's) started at the first pass, not at the
    # operator's question, and the pass proposed capacity then: nothing held it back
    first = passes[0]
    assert first.decision.gap_since == 10_310.0 and first.measured[M70].margin_since == 10_310.0
    assert first.decision.propose and first.plan.moves
