"""One pass of the periodic planning job, and the operator's dry run of the same plan.

The job is what makes a wrong placement visible: each pass turns the traffic window into
demand, solves for the best placement, publishes efficiency (goodput now / goodput best) and
asks the hysteresis gate whether the plan to get there should be proposed. It is kept here,
pure, so the daemon's scheduler, the gRPC service and the CLI all call one function and the
transport stays a thin conversion.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleetshift_common.errors import NotFound
from fleetshift_daemon.core.perfmodel import PerfModel
from fleetshift_daemon.core.planner import (
    ModelDemand,
    Placement,
    Planner,
    PlanningInput,
    Solution,
)
from fleetshift_daemon.core.plans import (
    Hysteresis,
    HysteresisDecision,
    MoveCostModel,
    Plan,
    build_plan,
)
from fleetshift_daemon.core.traffic import TrafficMonitor


def demand_from_traffic(monitor: TrafficMonitor, models: Iterable[str]) -> list[ModelDemand]:
    """The window's mix per model; a model with no traffic yet has zero demand."""
    out = []
    for name in models:
        try:
            out.append(ModelDemand.from_stats(monitor.stats(name)))
        except NotFound:
            out.append(ModelDemand(name, 0.0, 0.0, 0.0))
    return out


@dataclass(frozen=True)
class CycleReport:
    efficiency: float
    current_goodput_tokens_per_s: float
    best: Solution
    plan: Plan
    decision: HysteresisDecision


class PlanningCycle:
    def __init__(
        self,
        planner: Planner,
        perf: PerfModel,
        hysteresis: Hysteresis,
        costs: MoveCostModel | None = None,
    ) -> None:
        self._planner = planner
        self._perf = perf
        self._hysteresis = hysteresis
        self._costs = costs or MoveCostModel()

    def run(self, inp: PlanningInput, current: Placement) -> CycleReport:
        """The periodic pass: efficiency, the plan, and whether to propose it now."""
        plan, best = self._plan(inp, current)
        decision = self._hysteresis.observe(plan.efficiency_before, plan)
        return CycleReport(plan.efficiency_before, plan.goodput_before, best, plan, decision)

    def dry_run(self, inp: PlanningInput, current: Placement) -> Plan:
        """The same plan for an operator, without touching the hysteresis state."""
        return self._plan(inp, current)[0]

    def _plan(self, inp: PlanningInput, current: Placement) -> tuple[Plan, Solution]:
        best = self._planner.solve(inp, current)
        plan = build_plan(self._planner, self._perf, inp, current, best, self._costs)
        return plan, best
