"""The hindsight bound: per window, the best static placement for the traffic that will come.

For each window the oracle knows the future: it tries every candidate placement on the
window's real arrivals, starting from the state the fleet is actually in, scores each by the
requests of that window that meet their SLO (then by cost), keeps the best and moves to it
for free (output lengths known).

Candidates (``role_search``, the default): every role count of the fleet along its phase
order, i.e. with the instances ranked by how much faster they prefill than they decode
relative to the fleet (the order the balanced split uses), the first k prefill and the rest
decode, the first k prefill and the rest colocated, and the last k decode and the rest
colocated, for every k, plus all colocated. Each is tried with the daemon's router; the best
three are tried again with least-loaded routing (least pending tokens, as ``ll``) and with the
static split's (least time to clear them at the instance's rate for the window's mix). The
planner's placements for the window's true mix (cost mode, which may switch instances off,
and owned fleet) are tried with all three, and the previous window's choice again. A trial
scores the window's arrivals and the backlog unfinished when the window opens (scoring the
window's arrivals alone, the greedy choice starved the backlog and fell below the static
split on an overloaded Mooncake cut). Without ``role_search`` only the four shapes of earlier
rounds are tried (planner, planner for an owned fleet, balanced split, all mixed) with the
router and least-loaded routing: that bound was often no more than the better of
least-loaded and the static split.

It is greedy window by window, so it bounds what a placement policy that acts once per
window can reach; it is not a proof of optimality.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetshift_daemon.core import planner as pl
from fleetshift_daemon.sim.engine import Instance, Role, Simulator
from fleetshift_daemon.sim.fleetshift import (
    RouterPolicy,
    current_placement,
    demand_of,
    planning_input_for,
    simulated_planner_config,
    target_roles,
)
from fleetshift_daemon.sim.metrics import billed_dollars, unloaded_times
from fleetshift_daemon.sim.policies import (
    Mix,
    balanced_split,
    decode_rate,
    fits,
    least_busy,
    observed_mix,
    prefill_rate,
)

ORACLE_WINDOW_S = 300.0
RETRIES = 3  # the best role shapes under the router, tried again with the other two routings
ROUTINGS = ("router", "jsq", "rate")


@dataclass(frozen=True)
class Candidate:
    roles: tuple[Role, ...]
    routing: str  # "router" | "jsq" (least pending tokens) | "rate" (least time to clear them)
    label: str


class OraclePolicy(RouterPolicy):
    name = "oracle"
    tick_s: float | None = None

    def __init__(self, seed: int = 0) -> None:
        super().__init__(hindsight_outputs=True, seed=seed)
        self.routing = "router"
        self.choices: list[tuple[float, str]] = []
        self.prefill_rates: dict[int, float] = {}
        self.decode_rates: dict[int, float] = {}

    def apply(self, sim: Simulator, cand: Candidate, t: float, mix: Mix | None = None) -> None:
        """Move to ``cand`` for free; ``mix`` (the window's) sets the "rate" routing's rates."""
        self.routing = cand.routing
        if cand.routing == "rate":
            mix = mix or observed_mix(sim, t, t + ORACLE_WINDOW_S)
            cfg = sim.config
            for i in sim.instances:
                self.prefill_rates[i.idx] = prefill_rate(
                    i.timer, mix.mean_prompt, cfg.prefill_token_budget
                )
                self.decode_rates[i.idx] = decode_rate(i.timer, i.kv_cap, mix, cfg.max_batch)
        for inst, role in zip(sim.instances, cand.roles, strict=True):
            if role is not inst.role:
                sim.set_role(inst, role, t, "hindsight", 0.0)

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        if self.routing == "router":
            return super().route(sim, req, t)
        pool = [i for i in sim.instances if i.role in (Role.MIXED, Role.PREFILL)]
        if self.routing == "rate":  # as the static split routes
            return least_busy(sim, pool or sim.instances, req, t, self.prefill_rates)
        return _least_pending(sim, pool, req, t)

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance:
        if self.routing == "router":
            return super().pick_decode(sim, req, src, t)
        pool = [i for i in sim.instances if i.role in (Role.MIXED, Role.DECODE)]
        if self.routing == "rate":
            return least_busy(sim, pool, req, t, self.decode_rates) or src
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


def phase_order(sim: Simulator, mix: Mix) -> list[int]:
    """Instance indices, the most prefill-leaning first (relative to the fleet's mean rates)."""
    cfg = sim.config
    pre = np.array(
        [prefill_rate(i.timer, mix.mean_prompt, cfg.prefill_token_budget) for i in sim.instances]
    )
    dec = np.array([decode_rate(i.timer, i.kv_cap, mix, cfg.max_batch) for i in sim.instances])
    return [int(i) for i in np.argsort(-(pre / pre.mean()) / (dec / dec.mean()), kind="stable")]


def role_count_shapes(sim: Simulator, mix: Mix) -> dict[tuple[Role, ...], str]:
    """Every role count along the phase order: kP+rest D, kP+rest M, rest M+kD, all M."""
    order = phase_order(sim, mix)
    n = len(order)
    shapes: dict[tuple[Role, ...], str] = {(Role.MIXED,) * n: "mixed"}
    for k in range(1, n):
        for head, tail, label in (
            (Role.PREFILL, Role.DECODE, f"{k}P+{n - k}D"),
            (Role.PREFILL, Role.MIXED, f"{k}P+{n - k}M"),
        ):
            roles = [tail] * n
            for i in order[:k]:
                roles[i] = head
            shapes.setdefault(tuple(roles), label)
        roles = [Role.MIXED] * n
        for i in order[n - k :]:
            roles[i] = Role.DECODE
        shapes.setdefault(tuple(roles), f"{n - k}M+{k}D")
    return shapes


def planner_shapes(sim: Simulator, start: float, end: float) -> dict[tuple[Role, ...], str]:
    shapes: dict[tuple[Role, ...], str] = {}
    planner = pl.Planner(sim.model, simulated_planner_config(sim, None))
    demand = demand_of(sim, start, end)
    if demand.arrival_rate_per_s > 0:
        for keep_all, label in ((False, "planner"), (True, "planner-all")):
            inp = planning_input_for(sim, demand, keep_all)
            sol = planner.solve(inp, current_placement(sim))
            shapes.setdefault(tuple(target_roles(sim, sol.placement)), label)
    return shapes


def candidates(sim: Simulator, start: float, end: float, prev: Candidate | None) -> list[Candidate]:
    """The four shapes of earlier rounds, each with both routers (``role_search=False``)."""
    n = len(sim.instances)
    shapes = planner_shapes(sim, start, end)
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


Score = tuple[int, float]  # (requests of the window within SLO, -billed dollars)


class _Window:
    """One window's trials: each candidate run from the fleet's real state on the window."""

    def __init__(self, sim: Simulator, start: float, end: float, limits: tuple[Any, Any]) -> None:
        self.sim, self.start, self.end = sim, start, end
        arrival = sim.trace.arrival_s
        lo, hi = (int(x) for x in np.searchsorted(arrival, [start, end], side="left"))
        # Scored: the window's arrivals and the backlog still unfinished when it opens, so a
        # shape that serves the new requests by starving the queued ones does not look best.
        log = sim.log
        backlog = np.flatnonzero(np.isnan(log.finish_s[:lo]) & ~log.dropped[:lo])
        self.req = np.concatenate([backlog, np.arange(lo, hi)])
        self.ttft_max, self.tbt_max = limits
        self.mix = observed_mix(sim, start, end)
        self.tried: dict[tuple[tuple[Role, ...], str], Score] = {}
        self._best: tuple[Score, Simulator, Candidate] | None = None  # only the best is kept

    def trial(self, cand: Candidate) -> Score:
        key = (cand.roles, cand.routing)
        if key not in self.tried:
            score, trial, _ = self._run(cand)
            self.tried[key] = score
            if self._best is None or score > self._best[0]:
                self._best = (score, trial, cand)
        return self.tried[key]

    def _run(self, cand: Candidate) -> tuple[Score, Simulator, Candidate]:
        sim, r = self.sim, self.req
        trial = sim.snapshot()
        assert isinstance(trial.policy, OraclePolicy)
        trial.policy.apply(trial, cand, self.start, self.mix)
        trial.run_until(self.end)
        probe = trial.snapshot()
        probe.arrival_stop = trial.next_arrival
        probe.run_until(math.inf)
        log = probe.log
        arrival = sim.trace.arrival_s
        ttft = log.first_token_s[r] - arrival[r]
        o = sim.output[r]
        tbt = (log.finish_s[r] - log.first_token_s[r]) / np.maximum(o - 1, 1)
        ok = (
            ~np.isnan(log.finish_s[r])
            & (ttft <= self.ttft_max[r])
            & ((o == 1) | (tbt <= self.tbt_max[r]))
        )
        probe.finish()
        return (int(ok.sum()), -billed_dollars(probe)), trial, cand

    def best(self) -> tuple[Simulator, Candidate]:
        assert self._best is not None
        return self._best[1], self._best[2]


def _search(w: _Window, prev: Candidate | None, role_search: bool) -> None:
    sim, start, end = w.sim, w.start, w.end
    if not role_search:
        for cand in candidates(sim, start, end, prev):
            w.trial(cand)
        return
    for roles, label in planner_shapes(sim, start, end).items():
        for mode in ROUTINGS:
            w.trial(Candidate(roles, mode, f"{label}/{mode}"))
    if prev is not None:
        w.trial(prev)
    shapes = role_count_shapes(sim, w.mix)
    scored = [
        (w.trial(Candidate(r, "router", f"{lab}/router")), r, lab) for r, lab in shapes.items()
    ]
    scored.sort(key=lambda x: x[0], reverse=True)  # stable: ties keep the shape order
    for _, roles, label in scored[:RETRIES]:
        for mode in ROUTINGS[1:]:
            w.trial(Candidate(roles, mode, f"{label}/{mode}"))


def run_oracle(
    sim: Simulator, window_s: float = ORACLE_WINDOW_S, role_search: bool = True
) -> Simulator:
    """Run ``sim`` (built with an ``OraclePolicy``) window by window; returns the final state."""
    assert isinstance(sim.policy, OraclePolicy)
    u_ttft, u_tbt = unloaded_times(sim)
    slo = sim.fleet.slo
    limits = (u_ttft * slo.ttft_multiple, u_tbt * slo.tbt_multiple)
    sim.start()
    prev: Candidate | None = None
    t = 0.0
    while t <= sim.trace.duration_s:
        end = t + window_s
        w = _Window(sim, t, end, limits)
        _search(w, prev, role_search)
        sim, prev = w.best()
        assert isinstance(sim.policy, OraclePolicy)
        sim.policy.choices.append((t, prev.label))
        t = end
    sim.run_until(math.inf)
    sim.finish()
    return sim
