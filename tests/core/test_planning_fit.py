"""Issue 11's planning-cycle fixes, pinned on the core alone: bursts past the fleet, mix
and mix shifts."""

from __future__ import annotations

import numpy as np

from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM
from fleetshift_daemon.core.perfmodel import PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelDemand,
    ModelSpec,
    NodeCapacity,
    Placement,
    Planner,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.planning_cycle import LoopConfig, PlanningCycle, recent_lengths
from fleetshift_daemon.core.plans import Hysteresis
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.slo_monitor import SloMonitor

from ..clock import ManualClock

M70 = "llama2-70b"
NODES = [NodeCapacity(f"a100-{i}", A100_SXM_80GB, 8) for i in range(2)] + [
    NodeCapacity(f"h100-{i}", H100_SXM, 8) for i in range(4)
]


def _inp(demand: ModelDemand, min_workers: int = 0):  # type: ignore[no-untyped-def]
    return planning_input(
        NODES,
        [ModelSpec(llama2_70b(), tp_options=(8,), min_workers=min_workers)],
        [demand],
        default_slo=SloTarget(2000, 100),
    )


def _cycle(clock: ManualClock, monitor: SloMonitor | None = None) -> PlanningCycle:
    perf = PerfModel()
    return PlanningCycle(Planner(perf), perf, Hysteresis(clock), clock=clock, slo_monitor=monitor)


def _roomiest_rate(mean: ModelDemand) -> float:
    """Requests/s the whole fleet serves at the mean mix (by the model)."""
    probe = _inp(ModelDemand(M70, 1000.0, mean.mean_prompt_tokens, mean.mean_output_tokens))
    return Planner(PerfModel()).solve(probe).evaluation.served_requests_per_s[M70]


def test_a_burst_past_the_fleet_never_costs_the_mean_mix() -> None:
    # The mean needs 60 % of the fleet; the burst-sized need (a prefill factor far above
    # decode's, as a 10x prompt burst gives) is past all of it. The plan must still serve
    # the mean mix in full: a split skewed towards the burst's prefill may not.
    shape = ModelDemand(M70, 1.0, 1100.0, 260.0)
    rate = 0.6 * _roomiest_rate(shape)
    sized = ModelDemand(M70, rate, 1100.0, 260.0, prefill_peak_factor=18.0, decode_peak_factor=2.8)
    clock = ManualClock(1000.0)
    report = _cycle(clock).run(_inp(sized, min_workers=len(NODES)), Placement())
    mean = _inp(ModelDemand(M70, rate, 1100.0, 260.0))
    served = Planner(PerfModel()).evaluate(mean, report.best.placement)
    assert served.served_requests_per_s[M70] >= rate * 0.999
    assert {w.role for w in report.best.placement.workers} == {Role.MIXED}


def test_recent_lengths_follow_a_shift_and_ignore_noise() -> None:
    rng = np.random.default_rng(3)
    now, loop = 300.0, LoopConfig()
    times = np.sort(rng.uniform(0.0, now, 600))
    outputs = rng.exponential(200.0, times.size)
    chat = rng.exponential(300.0, times.size)
    d = ModelDemand(M70, 2.0, float(chat.mean()), float(outputs.mean()))
    assert recent_lengths(d, (times, chat, outputs), now, loop) == d  # same mix: unchanged
    shifted = np.where(times >= now - 60.0, rng.exponential(3000.0, times.size), chat)
    d = ModelDemand(M70, 2.0, float(shifted.mean()), float(outputs.mean()))
    after = recent_lengths(d, (times, shifted, outputs), now, loop)
    recent = shifted[times >= now - 60.0].mean()
    assert abs(after.mean_prompt_tokens - recent) < 1e-6 * recent
    assert after.arrival_rate_per_s == d.arrival_rate_per_s  # the rate is the window's
