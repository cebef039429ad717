"""The hindsight bound: per window, the best static placement for the traffic that will come.

For each window the oracle knows the future: it tries every candidate placement on the
window's real arrivals, starting from the state the fleet is actually in, scores each by the
requests of that window that meet their SLO (then by cost), keeps the best and moves to it
for free. Candidates are the planner's best placement for the window's true mix, the
balanced phase split for it, an all-colocated fleet and the previous window's choice, each
with the daemon's soft-score router and with least-loaded routing (output lengths known).
It is greedy window by window, so it bounds what a placement policy that acts once per
window can reach; it is not a proof of optimality.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleetshift_daemon.core import planner as pl
from fleetshift_daemon.sim.engine import Instance, Role, Simulator
from fleetshift_daemon.sim.fleetshift import (
    RouterPolicy,
    current_placement,
    demand_of,
    planning_input_for,
    target_roles,
)
from fleetshift_daemon.sim.metrics import billed_dollars, unloaded_times
from fleetshift_daemon.sim.policies import balanced_split, fits, observed_mix

ORACLE_WINDOW_S = 300.0


@dataclass(frozen=True)
class Candidate:
    roles: tuple[Role, ...]
    routing: str  # "router" | "jsq"
    label: str


class OraclePolicy(RouterPolicy):
    name = "oracle"
    tick_s: float | None = None

    def __init__(self, seed: int = 0) -> None:
        super().__init__(hindsight_outputs=True, seed=seed)
        self.routing = "router"
        self.choices: list[tuple[float, str]] = []

    def apply(self, sim: Simulator, cand: Candidate, t: float) -> None:
        self.routing = cand.routing
        for inst, role in zip(sim.instances, cand.roles, strict=True):
            if role is not inst.role:
                sim.set_role(inst, role, t, "hindsight", 0.0)

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        if self.routing == "router":
            return super().route(sim, req, t)
        pool = [i for i in sim.instances if i.role in (Role.MIXED, Role.PREFILL)]
        return _least_pending(sim, pool, req, t)

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance:
        if self.routing == "router":
            return super().pick_decode(sim, req, src, t)
        pool = [i for i in sim.instances if i.role in (Role.MIXED, Role.DECODE)]
        return _least_pending(sim, pool, req, t) or src


def _least_pending(sim: Simulator, pool: Sequence[Instance], req: int, t: float) -> Instance | None:
    best = None
    load = 0
    for inst in pool:
        if fits(sim, inst, req):
            x = inst.pending_tokens(t)
            if best is None or x < load:
                best, load = inst, x
    return best


def candidates(sim: Simulator, start: float, end: float, prev: Candidate | None) -> list[Candidate]:
    n = len(sim.instances)
    shapes: dict[tuple[Role, ...], str] = {}
    planner = pl.Planner(sim.model, pl.PlannerConfig(max_decode_batch=sim.config.max_batch))
    demand = demand_of(sim, start, end)
    if demand.arrival_rate_per_s > 0:
        for keep_all, label in ((False, "planner"), (True, "planner-all")):
            inp = planning_input_for(sim, demand, keep_all)
            sol = planner.solve(inp, current_placement(sim))
            shapes.setdefault(tuple(target_roles(sim, sol.placement)), label)
    shapes.setdefault(tuple(balanced_split(sim, observed_mix(sim, start, end))), "split")
    shapes.setdefault((Role.MIXED,) * n, "mixed")
    out = [
        Candidate(r, mode, f"{label}/{mode}")
        for r, label in shapes.items()
        for mode in ("router", "jsq")
    ]
    if prev is not None and all(c.roles != prev.roles or c.routing != prev.routing for c in out):
        out.append(prev)
    return out


def run_oracle(sim: Simulator, window_s: float = ORACLE_WINDOW_S) -> Simulator:
    """Run ``sim`` (built with an ``OraclePolicy``) window by window; returns the final state."""
    assert isinstance(sim.policy, OraclePolicy)
    u_ttft, u_tbt = unloaded_times(sim)
    slo = sim.fleet.slo
    ttft_max = u_ttft * slo.ttft_multiple
    tbt_max = u_tbt * slo.tbt_multiple
    arrival = sim.trace.arrival_s
    sim.start()
    prev: Candidate | None = None
    t = 0.0
    while t <= sim.trace.duration_s:
        end = t + window_s
        lo, hi = np.searchsorted(arrival, [t, end], side="left")
        best: tuple[tuple[int, float], Simulator, Candidate] | None = None
        for cand in candidates(sim, t, end, prev):
            trial = sim.snapshot()
            assert isinstance(trial.policy, OraclePolicy)
            trial.policy.apply(trial, cand, t)
            trial.run_until(end)
            probe = trial.snapshot()
            probe.arrival_stop = trial.next_arrival
            probe.run_until(math.inf)
            log = probe.log
            ttft = log.first_token_s[lo:hi] - arrival[lo:hi]
            o = sim.output[lo:hi]
            tbt = (log.finish_s[lo:hi] - log.first_token_s[lo:hi]) / np.maximum(o - 1, 1)
            ok = (
                ~np.isnan(log.finish_s[lo:hi])
                & (ttft <= ttft_max[lo:hi])
                & ((o == 1) | (tbt <= tbt_max[lo:hi]))
            )
            probe.finish()
            score = (int(ok.sum()), -billed_dollars(probe))
            if best is None or score > best[0]:
                best = (score, trial, cand)
        assert best is not None
        sim, prev = best[1], best[2]
        assert isinstance(sim.policy, OraclePolicy)
        sim.policy.choices.append((t, prev.label))
        t = end
    sim.run_until(math.inf)
    sim.finish()
    return sim
