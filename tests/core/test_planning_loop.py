"""The planning cycle with measured latency: capacity at once, retirements only on margin."""

from __future__ import annotations

from fleetshift_daemon.core.gpus import H100_SXM, H200_SXM
from fleetshift_daemon.core.perfmodel import Dtype, PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelDemand,
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.planning_cycle import PlanningCycle
from fleetshift_daemon.core.plans import Hysteresis, HysteresisConfig, MoveKind
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.slo_monitor import LatencySample, SloMonitor, SloMonitorConfig

from ..clock import ManualClock

M70 = "llama2-70b"
NODES = [NodeCapacity(f"h100-{i}", H100_SXM, 8) for i in range(2)] + [
    NodeCapacity(f"h200-{i}", H200_SXM, 8) for i in range(2)
]


def _inp(rate: float):  # type: ignore[no-untyped-def]
    return planning_input(
        NODES,
        [ModelSpec(llama2_70b(), tp_options=(8,))],
        [ModelDemand(M70, rate, 1000, 200)],
        default_slo=SloTarget(2000, 100),
    )


def _placement(nodes: list[str]) -> Placement:
    return Placement(
        tuple(
            PlacedWorker(M70, Role.MIXED, n.split("-")[0].upper() + "-SXM", 8, Dtype.BF16, n, n)
            for n in nodes
        )
    )


def _cycle(clock: ManualClock, monitor: SloMonitor) -> PlanningCycle:
    perf = PerfModel()
    gate = Hysteresis(clock, HysteresisConfig(threshold=0.05, hold_s=300.0, min_hold_s=300.0))
    return PlanningCycle(Planner(perf), perf, gate, clock=clock, slo_monitor=monitor)


def _reports(nodes: list[str], ttft_p99: float) -> list[LatencySample]:
    return [LatencySample(n, M70, ttft_p99 / 3, ttft_p99, 20.0, 40.0, 0, 16) for n in nodes]


def test_measured_misses_bring_capacity_back_at_once_though_the_model_is_content() -> None:
    clock = ManualClock(1000.0)
    monitor = SloMonitor(clock)
    cycle = _cycle(clock, monitor)
    serving = ["h200-0"]
    light = _inp(0.5)  # the model: one H200 serves this with room to spare
    quiet = cycle.run(light, _placement(serving))
    assert not quiet.decision.propose and quiet.efficiency == 1.0
    monitor.observe(_reports(serving, ttft_p99=8000.0))  # reality: 4x the TTFT SLO at p99
    report = cycle.run(light, _placement(serving))
    assert report.decision.propose, report.decision.reason
    assert "at risk" in report.decision.reason
    kinds = {m.kind for m in report.plan.moves}
    assert kinds and kinds <= {MoveKind.START, MoveKind.ROLE_CHANGE}  # nothing taken away
    assert report.measured[M70].at_risk and report.measured_attainment is not None
    assert report.measured_attainment < 0.99 <= report.predicted_attainment


def test_surplus_retires_only_after_measured_margin_held_for_the_hold() -> None:
    clock = ManualClock(1000.0)
    monitor = SloMonitor(clock, SloMonitorConfig(retire_hold_s=600.0))
    cycle = _cycle(clock, monitor)
    serving = ["h100-0", "h100-1", "h200-0", "h200-1"]
    light = _inp(0.5)
    for _ in range(6):  # ten minutes short of the hold: reports fine, no retiring
        monitor.observe(_reports(serving, ttft_p99=600.0))
        report = cycle.run(light, _placement(serving))
        assert not any(
            m.kind is MoveKind.STOP for m in report.plan.moves if report.decision.propose
        )
        clock.advance(100.0)
    monitor.observe(_reports(serving, ttft_p99=600.0))
    report = cycle.run(light, _placement(serving))
    assert report.decision.propose and "margin held" in report.decision.reason
    stops = [m for m in report.plan.moves if m.kind is MoveKind.STOP]
    assert stops and len(stops) < len(serving)


def _split(prefill: list[str], decode: list[str]) -> Placement:
    def worker(n: str, role: Role) -> PlacedWorker:
        return PlacedWorker(M70, role, n.split("-")[0].upper() + "-SXM", 8, Dtype.BF16, n, n)

    return Placement(
        tuple(worker(n, Role.PREFILL) for n in prefill)
        + tuple(worker(n, Role.DECODE) for n in decode)
    )


def test_a_decode_memory_shortage_brings_decode_capacity_not_prefill() -> None:
    # A split pair whose decode worker ran out of KV: hand-offs wait on it, the prefill
    # worker's KV is held by their prompts, its prompt queue grows and TTFT misses. The
    # capacity that comes back must serve decode; a prefill worker would only queue more.
    clock = ManualClock(1000.0)
    monitor = SloMonitor(clock)
    cycle = _cycle(clock, monitor)
    current = _split(["h200-0"], ["h200-1"])
    light = _inp(0.5)
    cycle.run(light, current)
    for q in (4, 8, 16, 32):
        monitor.observe(
            [
                LatencySample(
                    "h200-0", M70, 2000.0, 9000.0, 0.0, 0.0, q, q, Role.PREFILL, 990, 1000
                ),
                LatencySample(
                    "h200-1", M70, 0.0, 0.0, 40.0, 90.0, q, 64 + q, Role.DECODE, 998, 1000
                ),
            ]
        )
        clock.advance(10.0)
    report = cycle.run(light, current)
    assert report.decision.propose and "at risk" in report.decision.reason
    assert report.measured[M70].decode_short and not report.measured[M70].prefill_short
    roles = [m.target.role for m in report.plan.moves if m.target is not None]
    assert roles and all(r in (Role.DECODE, Role.MIXED) for r in roles), report.plan.moves
