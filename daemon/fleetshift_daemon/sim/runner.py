"""Run several policies on one fleet and trace, sharing the step-time caches between them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.perfmodel import Deployment, PerfModel
from fleetshift_daemon.core.planner import PlannerConfig
from fleetshift_daemon.sim.engine import Policy, SimConfig, Simulator
from fleetshift_daemon.sim.fleet import SimFleet
from fleetshift_daemon.sim.fleetshift import FleetShift
from fleetshift_daemon.sim.metrics import Summary, summarize
from fleetshift_daemon.sim.oracle import ORACLE_WINDOW_S, OraclePolicy, run_oracle
from fleetshift_daemon.sim.policies import LeastLoaded, RoundRobin, StaticSplit
from fleetshift_daemon.sim.timing import StepTimer
from fleetshift_daemon.sim.trace import Trace

POLICIES = ("rr", "ll", "split", "fleetshift", "fleetshift-all", "oracle")


@dataclass(frozen=True)
class RunOptions:
    seed: int = 0
    tick_s: float = 60.0
    oracle_window_s: float = ORACLE_WINDOW_S
    config: SimConfig = field(default_factory=SimConfig)
    # The FleetShift policies' planner settings (None: the daemon's defaults). Lets a bench
    # replay a default's old value beside the new one from the same tree.
    planner: PlannerConfig | None = None


@dataclass
class RunResult:
    name: str
    sim: Simulator
    summary: Summary


def make_policy(name: str, opts: RunOptions) -> Policy:
    factories: dict[str, Callable[[], Policy]] = {
        "rr": RoundRobin,
        "ll": LeastLoaded,
        "split": StaticSplit,
        "fleetshift": lambda: FleetShift(
            tick_s=opts.tick_s, seed=opts.seed, planner_config=opts.planner
        ),
        "fleetshift-all": lambda: FleetShift(
            tick_s=opts.tick_s, seed=opts.seed, keep_all=True, planner_config=opts.planner
        ),
        "oracle": lambda: OraclePolicy(seed=opts.seed),
    }
    if name not in factories:
        raise InvalidArgument(f"unknown policy {name!r} (known: {POLICIES})", field="policy")
    return factories[name]()


def policy_names(spec: str) -> list[str]:
    names = list(POLICIES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        if n not in POLICIES:
            raise InvalidArgument(f"unknown policy {n!r} (known: all, {POLICIES})", field="policy")
    return names


def run_policies(
    fleet: SimFleet,
    trace: Trace,
    names: Sequence[str],
    opts: RunOptions | None = None,
    model: PerfModel | None = None,
    on_done: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    opts = opts or RunOptions()
    model = model or PerfModel()
    timers: dict[Deployment, StepTimer] = {}
    results = []
    for name in names:
        sim = Simulator(fleet, trace, make_policy(name, opts), model, opts.config, timers)
        t0 = time.perf_counter()
        if name == "oracle":
            sim = run_oracle(sim, opts.oracle_window_s)
        else:
            sim.run()
        wall = time.perf_counter() - t0
        result = RunResult(name, sim, summarize(sim, name, wall))
        results.append(result)
        if on_done is not None:
            on_done(result)
    return results
