"""One pass of the periodic planning job, and the operator's dry run of the same plan.

The job is what makes a wrong placement visible: each pass turns the traffic window into
demand, solves for the best placement, publishes efficiency (goodput now / goodput best) and
asks the hysteresis gate whether the plan to get there should be proposed. It is kept here,
pure, so the daemon's scheduler, the gRPC service, the CLI and the simulator all call one
function and the transport stays a thin conversion.

Three mechanisms keep the pass honest on traffic nobody tuned it on (issue 11):

* **Burst-aware sizing** (``core.burst``): with a traffic monitor and a ``BurstSizer``, the
  demand carries peak factors from the window's arrival process, so a fleet is sized for its
  bursts, not their mean.
* **Headroom when the floor binds**: a model whose ``min_workers`` keeps more workers than its
  demand needs (an owned fleet) is served in full by almost any roles, so "goodput now / best"
  sits at 1.0 and roles never followed the mix. For such a model the pass compares
  placements at the load the best placement could just carry at the current mix: the roles
  with the most headroom for this mix win, and a mix shift opens a gap again.
* **Measured latency closes the loop** (``core.slo_monitor``): when the workers' measured
  latencies put the SLO at risk, a plan for more capacity (starts and role changes only) is
  proposed at once, bypassing the hold; retirements wait until measured attainment has kept a
  margin over the target for a sustained time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fleetshift_common.errors import FailedPrecondition, InvalidArgument, NotFound
from fleetshift_daemon.core.burst import BurstSizer
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.errors import UnsupportedDeployment
from fleetshift_daemon.core.perfmodel import Deployment, PerfModel
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
    Move,
    MoveCostModel,
    MoveKind,
    Plan,
    build_plan,
)
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.slo_monitor import SloAssessment, SloMonitor, SloThresholds
from fleetshift_daemon.core.traffic import TrafficMonitor

_PROBE_RATE = 1000.0  # "uncapped" demand when measuring a placement's headroom
_PROBE_MARGIN = 0.1  # the second headroom probe: this share above the relaxed bound's reach
_FIT_STEPS = 6  # bisection steps when lowering peak factors to what the fleet can carry
_FIT_TOLERANCE = 1e-3  # served within this share of the demand counts as carried


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
class LoopConfig:
    # At risk, the short phase is planned for this multiple of what the current placement
    # carries at the current mix (by the model): the model already thought the fleet enough,
    # so only the measurement says it is not, and not by how much; doubling is the smallest
    # step that surely adds capacity. Not tuned.
    risk_demand_factor: float = 2.0
    # After a capacity plan, the next waits until its moves could have landed, at least this.
    min_risk_interval_s: float = 60.0
    # With measured margin held, a plan that only retires (and re-roles) is proposed when it
    # saves this share of $/hour at no predicted goodput loss: a saving never opens the
    # efficiency gap, so without this the surplus of a load that fell would never retire.
    # 5 %, the gate's own gap threshold: not tuned.
    retire_saving: float = 0.05
    # Mix shifts: when the request lengths of the last ``recent_s`` differ from the rest of
    # the window's by more than ``shift_z`` standard errors (and each part holds at least
    # ``shift_min_requests``), the demand takes the recent lengths (see ``recent_lengths``).
    # A minute: a planning period; 3 standard errors: the usual bar for "not noise"; not tuned.
    recent_s: float = 60.0
    shift_z: float = 3.0
    shift_min_requests: int = 20

    def __post_init__(self) -> None:
        if not (math.isfinite(self.risk_demand_factor) and self.risk_demand_factor > 1):
            raise InvalidArgument("risk_demand_factor must be > 1", field="risk_demand_factor")
        if not (math.isfinite(self.min_risk_interval_s) and self.min_risk_interval_s >= 0):
            raise InvalidArgument("min_risk_interval_s must be >= 0", field="min_risk_interval_s")
        if not (math.isfinite(self.recent_s) and self.recent_s > 0):
            raise InvalidArgument("recent_s must be > 0", field="recent_s")
        if not (math.isfinite(self.shift_z) and self.shift_z > 0):
            raise InvalidArgument("shift_z must be > 0", field="shift_z")
        if self.shift_min_requests < 2:
            raise InvalidArgument("shift_min_requests must be >= 2", field="shift_min_requests")


@dataclass(frozen=True)
class CycleReport:
    efficiency: float
    current_goodput_tokens_per_s: float
    best: Solution
    plan: Plan
    decision: HysteresisDecision
    # the share of demand the model thinks the current placement serves within SLO
    predicted_attainment: float = 1.0
    measured: Mapping[str, SloAssessment] = field(default_factory=dict)

    @property
    def measured_attainment(self) -> float | None:
        """The lowest measured attainment over the models that reported latency."""
        values = [a.attainment for a in self.measured.values() if a.attainment is not None]
        return min(values) if values else None


class PlanningCycle:
    def __init__(
        self,
        planner: Planner,
        perf: PerfModel,
        hysteresis: Hysteresis,
        costs: MoveCostModel | None = None,
        *,
        clock: Callable[[], float] | None = None,
        traffic: TrafficMonitor | None = None,
        burst: BurstSizer | None = None,
        slo_monitor: SloMonitor | None = None,
        loop: LoopConfig | None = None,
    ) -> None:
        if (burst is not None and traffic is None) or (
            (burst is not None or slo_monitor is not None) and clock is None
        ):
            raise InvalidArgument(
                "burst sizing needs the traffic monitor, and it and the SLO monitor a clock",
                field="burst",
            )
        self._planner = planner
        self._perf = perf
        self._hysteresis = hysteresis
        self._costs = costs or MoveCostModel()
        self._clock = clock
        self._traffic = traffic
        self._burst = burst
        self._slo = slo_monitor
        self._loop = loop or LoopConfig()
        self._quiet_until = -math.inf
        # per model and phase: when the last worker the loop moved into that phase's pool
        # landed, and how many it holds on loan (received, less those given back since)
        self._lent: dict[str, dict[Phase, tuple[float, int]]] = {}

    def run(self, inp: PlanningInput, current: Placement, *, commit: bool = True) -> CycleReport:
        """The periodic pass: efficiency, the plan, and whether to propose it now.

        ``commit=False`` is the operator's dry run (``dry_run``): the same sizing, plan,
        gate and measured loop, so it names the plan this pass would propose or hold and
        why, but nothing the next pass reads is changed: the burst sizer's memory, the
        gate's clock, the SLO monitor's margin clock, the loop's quiet time and loans."""
        inp = self.sized(inp, record=commit)
        plan, best, predicted = self._plan(inp, current)
        gate = self._hysteresis.observe if commit else self._hysteresis.judge
        decision = gate(plan.efficiency_before, plan)
        measured = self._assess(inp, record=commit)
        plan, decision = self._close_loop(
            inp, current, plan, decision, measured, predicted, commit=commit
        )
        return CycleReport(
            plan.efficiency_before,
            plan.goodput_before,
            best,
            plan,
            decision,
            predicted,
            measured,
        )

    def dry_run(self, inp: PlanningInput, current: Placement) -> CycleReport:
        """What ``run`` would report now, changing nothing (see ``run``'s ``commit``)."""
        return self.run(inp, current, commit=False)

    # -- sizing -----------------------------------------------------------------------------
    def sized(self, inp: PlanningInput, *, record: bool = True) -> PlanningInput:
        """``inp`` with burst peak factors on each model's demand, recent request lengths
        after a mix shift, fitted to what the fleet can carry (``within_fleet``).
        ``record=False`` leaves the burst sizer's memory as it was (a dry run)."""
        if self._burst is None or self._traffic is None:
            return self.within_fleet(inp)
        span = self._traffic.config.window_s
        now = self._clock() if self._clock is not None else 0.0
        demand = {}
        for spec in inp.models:
            name = spec.arch.name
            d = inp.demand.get(name)
            if d is None:
                continue
            arrivals = self._traffic.arrivals(name)
            d = recent_lengths(d, arrivals, now, self._loop)
            restart = restart_s(self._perf, inp, name, self._costs)
            demand[name] = self._burst.size(
                d, arrivals, span, inp.slo(name), restart, record=record
            )
        return self.within_fleet(replace(inp, demand=demand))

    def within_fleet(self, inp: PlanningInput) -> PlanningInput:
        """``inp`` fitted to a fleet that cannot carry its bursts (unchanged when it can).

        A burst the whole fleet cannot carry is not worth planning for at any price: the
        planner would serve as much of the *sized* demand as it can, and because the phases'
        factors differ (prefill's delay budget is a second, decode's tens of seconds, so a
        10x burst asks far more prefill than decode), it buys that with a skewed split that
        cannot even serve the mean mix (issue 11: on 10x on-off bursts, 9 of 12 instances
        prefilling, serving 76 % of the mean by the model's own count, where the colocated
        fleet serves all of it). So, when the best placement cannot serve the sized demand:

        * the peak factors are lowered, all by one share of their excess over 1 (bisection),
          until the best placement serves them in full: the mean stays served and as much of
          the burst is covered as the fleet allows;
        * the model's workers are planned colocated (mixed) when that still serves the mean:
          a burst past the fleet's capacity is met best by every instance prefilling it,
          while split pools leave the decode pool idle through the prompt burst (the
          planner's steady-state picture of a mixed worker, both phases' peaks at once, cannot
          see that the two peaks come at different times).
        """
        peaked = {
            n: d
            for n, d in inp.demand.items()
            if d.arrival_rate_per_s > 0 and max(d.prefill_peak_factor, d.decode_peak_factor) > 1
        }
        if not peaked or self._carries(inp, peaked):
            return inp
        pooled = _colocated(inp, peaked)
        if pooled is not inp and self._carries(_peaks_scaled(pooled, peaked, 0.0), peaked):
            inp = pooled
        lo, hi = 0.0, 1.0
        for _ in range(_FIT_STEPS):
            mid = (lo + hi) / 2
            if self._carries(_peaks_scaled(inp, peaked, mid), peaked):
                lo = mid
            else:
                hi = mid
        return _peaks_scaled(inp, peaked, lo)

    def _carries(self, inp: PlanningInput, models: Mapping[str, ModelDemand]) -> bool:
        try:
            served = self._planner.solve(inp).evaluation.served_requests_per_s
        except FailedPrecondition:  # e.g. colocated only, too few shapes for the worker floor
            return False
        return all(
            served.get(n, 0.0) >= inp.demand[n].arrival_rate_per_s * (1.0 - _FIT_TOLERANCE)
            for n in models
        )

    # -- planning ---------------------------------------------------------------------------
    def best(self, inp: PlanningInput, current: Placement) -> tuple[PlanningInput, Solution]:
        """The placement a pass aims for, and the demand it is judged at: the planner's best,
        or, for models whose worker floor binds (an owned fleet), the roles with the most
        headroom at this mix (see ``_headroom``). A deploy uses it too, so that an owned
        fleet starts from the roles its first pass would choose, not from whichever of the
        many placements that carry a light load the solver met first."""
        best = self._planner.solve(inp, current)
        probed = self._headroom(inp, current, best)
        return probed if probed is not None else (inp, best)

    def _plan(self, inp: PlanningInput, current: Placement) -> tuple[Plan, Solution, float]:
        predicted = _served_share(self._planner, inp, current)
        judged, best = self.best(inp, current)
        plan = build_plan(self._planner, self._perf, judged, current, best, self._costs)
        return plan, best, predicted

    def _headroom(
        self, inp: PlanningInput, current: Placement, best: Solution
    ) -> tuple[PlanningInput, Solution] | None:
        """For models whose worker floor binds: the placement with the most headroom at the
        current mix (solved at a demand no placement can carry), and the demand scaled to
        what it can just carry, at which the current placement is then judged."""
        counts: dict[str, int] = {}
        for w in best.placement.workers:
            counts[w.model] = counts.get(w.model, 0) + 1
        floored = {
            m.arch.name
            for m in inp.models
            if m.min_workers > 0
            and counts.get(m.arch.name, 0) <= m.min_workers
            and (d := inp.demand.get(m.arch.name)) is not None
            and d.arrival_rate_per_s > 0
        }
        if not floored:
            return None
        roomiest = self._roomiest(inp, current, floored)
        served = roomiest.evaluation.served_requests_per_s
        scale = {}
        for name in floored:
            headroom = served.get(name, 0.0) / inp.demand[name].arrival_rate_per_s
            if headroom > 1.0:
                scale[name] = headroom
        return (_scaled(inp, scale), roomiest) if scale else None

    def _roomiest(self, inp: PlanningInput, current: Placement, floored: set[str]) -> Solution:
        """The placement that carries the most of ``floored`` models' demand at this mix.

        Solved twice. A probe at ``_PROBE_RATE`` finds roughly how much the fleet can carry
        (and the LP relaxation's bound on it); the answer is then solved at just above that
        (``_PROBE_MARGIN`` over the bound's share). The solver's tolerance is a share of the
        *unserved* demand, so at the raw probe (1,000 requests/s, hundreds of times what a
        fleet carries) it accepted any placement within a few percent of the whole probe:
        on the Mooncake mix (tuning minutes) it returned placements carrying up to 35 % less
        than the roomiest, a different one from pass to pass, and the gate then compared the
        current roles with a reference that moved by solver noise, proposing plans that undid
        the last one (issue 11, round 4)."""
        wide = _scaled(inp, {name: _PROBE_RATE for name in floored})
        first = self._planner.solve(wide, current)
        found = first.evaluation.goodput_tokens_per_s
        if found <= 0:
            return first
        room = first.goodput_bound_tokens_per_s / found * (1.0 + _PROBE_MARGIN)
        served = first.evaluation.served_requests_per_s
        rates = {n: max(served.get(n, 0.0), 1e-9) * room for n in floored}
        probe = {n: r / inp.demand[n].arrival_rate_per_s for n, r in rates.items()}
        second = self._planner.solve(_scaled(inp, probe), current)
        if second.evaluation.goodput_tokens_per_s < found * (1.0 - _FIT_TOLERANCE) or any(
            second.evaluation.served_requests_per_s.get(n, 0.0) >= r * (1.0 - _FIT_TOLERANCE)
            for n, r in rates.items()
        ):  # carried in full: the probe was not above every placement's reach after all
            return first
        return second

    # -- the measured loop ------------------------------------------------------------------
    def _assess(self, inp: PlanningInput, *, record: bool) -> dict[str, SloAssessment]:
        if self._slo is None:
            return {}
        out = {}
        for spec in inp.models:
            name = spec.arch.name
            slo = inp.slo(name)
            out[name] = self._slo.assess(
                name, SloThresholds(slo.ttft_ms, slo.tbt_ms), record=record
            )
        return out

    def _close_loop(
        self,
        inp: PlanningInput,
        current: Placement,
        plan: Plan,
        decision: HysteresisDecision,
        measured: Mapping[str, SloAssessment],
        predicted: float,
        *,
        commit: bool,
    ) -> tuple[Plan, HysteresisDecision]:
        if not measured:
            return plan, decision
        assert self._clock is not None
        now = self._clock()
        risky = {n: a for n, a in measured.items() if a.at_risk}
        target = min(a.target for a in measured.values())
        short = predicted < target  # the model itself says the fleet cannot carry the bursts
        if (risky or short) and now >= self._quiet_until:
            adding = self._capacity_plan(inp, current, risky, plan)
            if adding.moves:
                if commit:
                    landed = max(m.duration_s for m in adding.moves)
                    self._note_loans(adding.moves, now)
                    self._quiet_until = now + max(self._loop.min_risk_interval_s, landed)
                why = "; ".join(f"{n}: {a.reason}" for n, a in risky.items()) or (
                    f"the model serves {predicted:.1%} of the burst-sized demand"
                )
                return adding, HysteresisDecision(
                    True,
                    decision.gap,
                    decision.gap_since,
                    f"SLO at risk ({why}): {len(adding.moves)} moves bring capacity back now",
                )
        if not decision.propose:
            return self._surplus(inp, current, plan, decision, measured)
        if risky:
            plan, decision = _sparing_short(plan, decision, risky, current)
            if not decision.propose:
                return plan, decision
        held = [n for n, a in measured.items() if not a.retire_ok]
        stops = [m for m in plan.moves if m.kind is MoveKind.STOP and m.model in held]
        why = f"{len(stops)} retirements held: measured margin not sustained"
        return _holding(plan, decision, stops, why)

    def _surplus(
        self,
        inp: PlanningInput,
        current: Placement,
        plan: Plan,
        decision: HysteresisDecision,
        measured: Mapping[str, SloAssessment],
    ) -> tuple[Plan, HysteresisDecision]:
        """Retire what the best placement leaves out, once measured margin has held."""
        shrink = {MoveKind.STOP, MoveKind.ROLE_CHANGE}
        if not any(m.kind is MoveKind.STOP for m in plan.moves) or any(
            m.kind not in shrink for m in plan.moves
        ):
            return plan, decision
        stopping = {m.model for m in plan.moves if m.kind is MoveKind.STOP}
        if not all(measured[n].retire_ok for n in stopping if n in measured):
            return plan, decision
        if plan.goodput_after < plan.goodput_before * (1.0 - 1e-6):
            return plan, decision
        now_cost = self._planner.evaluate(inp, current).cost_per_hour
        after = _stopped(current, plan)
        then_cost = self._planner.evaluate(inp, after).cost_per_hour
        if then_cost > now_cost * (1.0 - self._loop.retire_saving):
            return plan, decision
        why = (
            f"measured margin held: retiring {sum(m.kind is MoveKind.STOP for m in plan.moves)} "
            f"workers saves {1 - then_cost / max(now_cost, 1e-9):.0%} of $/hour at no "
            "predicted goodput loss"
        )
        return plan, replace(decision, propose=True, reason=why)

    def _capacity_plan(
        self,
        inp: PlanningInput,
        current: Placement,
        risky: Mapping[str, SloAssessment],
        plan: Plan,
    ) -> Plan:
        """Starts (and role changes towards the short phase) for the phases measured short.

        The phase the measurements say is short (prompts queued with KV free, or TTFT
        misses with nothing waiting for memory: prefill; TBT misses, hand-offs queued or
        requests waiting behind a full KV: decode, see ``SloAssessment``) is planned for
        ``risk_demand_factor`` times the larger of its sized need and what the current
        placement carries (by the model); without a measured miss the
        model's own shortfall stands and only its starts are taken. Nothing that takes
        capacity away (a stop, a move, a role change off the short phase) is in it.

        On an owned fleet (the worker floor keeps every worker) nothing can be started, so
        the plan is role changes only, and a role change brings no capacity back: it moves a
        worker from one phase to the other at the price of a pause. There each is kept only
        where the measurements vouch for both sides of the trade (``_within_spare``): the
        risk lies in one phase, and the pool that gives the worker has measured spare
        (``SloAssessment.prefill_spare``, ``decode_spare``: its own latency within target,
        no worker waiting on a full KV, its queue not growing over a fully observed horizon,
        its KV fitting on the workers that stay), and a pool the loop has just given workers
        gives back at most those until its margin has held since (``_unlent``). An owned
        fleet saturated in both phases has no such pool; re-roling it on every "at risk"
        traded one shortage for the other at each pass (issue 11: 16-23 moves on Mooncake at
        x4, half the goodput of none), so its roles are left to the gated path, which weighs
        a re-role's gain against its cost. A fleet that can start workers keeps the role
        changes of a capacity plan that also starts workers for the short phase: filtering
        those cost its cost-mode runs up to 3 points of SLO on the tuning rows (issue 11
        Rounds 9-10). A plan with no such start (every node already serving, on a fleet near
        or past its size) is the owned fleet's case, and its role changes pass the same
        filter (Round 11: on the tuning rows 16 -> 17 cells within a point of least-loaded,
        on-off bursts at x4 13 -> 5 moves and +3.3 points)."""
        if not risky:
            return _only(plan, lambda m: m.kind is MoveKind.START)
        demand = dict(inp.demand)
        short: set[Phase] = set()
        # The model already thought the placement enough (it may carry many times the demand
        # on paper), so the short phase is sized from what the placement carries, not from
        # the demand alone.
        wide = _scaled(inp, {name: _PROBE_RATE for name in risky})
        carried = self._planner.evaluate(wide, current).served_requests_per_s
        f = self._loop.risk_demand_factor
        for name, a in risky.items():
            d = demand[name]
            room = carried.get(name, 0.0) / max(d.arrival_rate_per_s, 1e-9)
            phases = short_phases(a)
            prefill, decode = Phase.PREFILL in phases, Phase.DECODE in phases
            short |= phases
            # f times the larger of the sized need and what the placement carries now
            demand[name] = replace(
                d,
                prefill_peak_factor=f * max(d.prefill_peak_factor, room)
                if prefill
                else d.prefill_peak_factor,
                decode_peak_factor=f * max(d.decode_peak_factor, room)
                if decode
                else d.decode_peak_factor,
            )
        boosted = replace(inp, demand=demand)
        more = self._planner.solve(boosted, current)
        capacity = build_plan(self._planner, self._perf, boosted, current, more, self._costs)
        starts = replace(capacity, moves=tuple(_kept_source(m) for m in capacity.moves))
        adding = _only(starts, lambda m: _adds(m, short))
        # An owned fleet's role changes pass the filter; so do those of a fleet that could
        # start workers but has nothing to start for the short phase, where an owned one is.
        filtered = (
            _floor_bound(inp, current)
            if any(m.kind is MoveKind.START for m in adding.moves)
            else set(risky)
        )
        spare = {
            name: self._unlent(inp, name, _spare_counts(a))
            for name, a in risky.items()
            if name in filtered
        }
        return replace(adding, moves=_within_spare(adding.moves, short, spare))

    def _unlent(self, inp: PlanningInput, name: str, spare: dict[Phase, int]) -> dict[Phase, int]:
        """``spare`` less what a pool holds only on loan.

        A pool that has just been given a worker reads well because that worker relieved
        it, so its measured spare at that moment is no evidence of margin of its own: near
        capacity a shortage alternating between the phases then swung ever more workers each
        pass (issue 11, Mooncake at x2: one worker in, three back out, two in, three out).
        Until the pool's own margin has held at every round since the loan landed, over the
        growth test's full horizon (``SloMonitor.pool_held``), it may give back at most the
        workers it was lent: undoing a move stays possible, overshooting it is not. A loan
        older than the monitor's window is forgotten. No new threshold: the horizon, the
        window and the target are the monitor's own."""
        loans = self._lent.get(name)
        if not loans or self._slo is None or self._clock is None:
            return spare
        forgotten = self._clock() - self._slo.config.window_s
        slo = inp.slo(name)
        thresholds = SloThresholds(slo.ttft_ms, slo.tbt_ms)
        out = dict(spare)
        for p, (since, lent) in loans.items():
            if since < forgotten:
                continue
            if p in out and not self._slo.pool_held(name, _POOL[p], thresholds, since):
                out[p] = min(out[p], lent)
        return out

    def _note_loans(self, moves: Iterable[Move], now: float) -> None:
        """Book the measured loop's role changes: a phase a worker starts serving holds it
        on loan from when it lands; a phase it stops serving has given one of its loans back."""
        forgotten = now - self._slo.config.window_s if self._slo is not None else -math.inf
        for m in moves:
            if m.kind is not MoveKind.ROLE_CHANGE or m.source is None or m.target is None:
                continue
            loans = self._lent.setdefault(m.model, {})
            for p in [p for p, (since, _) in loans.items() if since < forgotten]:
                del loans[p]  # forgotten (``_unlent``): its count is not carried into a new one
            before, after = _SERVES[m.source.role], _SERVES[m.target.role]
            for p in after - before:
                lent = loans[p][1] if p in loans else 0
                loans[p] = (now + m.duration_s, lent + 1)
            for p in before - after:
                if p in loans:
                    since, lent = loans[p]
                    loans[p] = (since, max(lent - 1, 0))


_POOL = {Phase.PREFILL: Role.PREFILL, Phase.DECODE: Role.DECODE}
_SERVES = {
    Role.PREFILL: {Phase.PREFILL},
    Role.DECODE: {Phase.DECODE},
    Role.MIXED: {Phase.PREFILL, Phase.DECODE},
}


def short_phases(a: SloAssessment) -> set[Phase]:
    """The phases the measurements put the risk on: decode where TBT, hand-offs or a full
    KV say so, prefill where the prompts do, and prefill where neither is named (a TTFT
    miss with nothing waiting for memory is a prefill shortage, ``SloAssessment``)."""
    phases = {Phase.DECODE} if a.decode_short else set()
    if a.prefill_short or not a.decode_short:
        phases.add(Phase.PREFILL)
    return phases


def _takes_from(m: Move, short: set[Phase]) -> bool:
    """A stop of a worker serving a short phase, or a role change or move after which the
    worker no longer serves one (a start, or a move that keeps the phases, takes nothing)."""
    if m.source is None:
        return False
    before = _SERVES[m.source.role] & short
    if m.kind is MoveKind.STOP or m.target is None:
        return bool(before)
    return bool(before - _SERVES[m.target.role])


def _feeds_only_heard(m: Move, short: set[Phase], served: set[Phase]) -> bool:
    """Every phase the move's worker starts serving is served now (the monitor hears it) and
    is not measured short: the measurements say it needs nothing. A stop feeds no phase. A
    phase no worker serves reports nothing and so never reads short; there, as where both
    phases are short, the model is left to judge (issue 11, Round 14: the loop had re-roled
    every decode worker to prefill, and holding the gated plan's way back left the fleet
    without a decode pool)."""
    if m.target is None:
        return True
    gains = _SERVES[m.target.role] - (_SERVES[m.source.role] if m.source else set())
    return gains <= served - short


def _sparing_short(
    plan: Plan,
    decision: HysteresisDecision,
    risky: Mapping[str, SloAssessment],
    current: Placement,
) -> tuple[Plan, HysteresisDecision]:
    """A gated plan less the moves that take capacity from a phase measured short to give it
    to a phase the measurements hear and find not short (``_feeds_only_heard``).

    The gate weighs the model's gain; while the measurements say a model's SLO is at risk
    in a phase, the model's picture of that phase is what the measurements contradict. A
    gated plan proposed in the quiet after a capacity plan (its starts still landing) took
    back the workers the measured loop had just added (issue 11, Round 14: a service switch
    at x1, two decode workers re-roled to prefill ten seconds before the next "at risk"
    re-roled them back, decode batches of 140 sessions meanwhile). No threshold: the short
    phases are the monitor's own (``short_phases``)."""
    short = {name: short_phases(a) for name, a in risky.items()}
    served: dict[str, set[Phase]] = {}
    for w in current.workers:
        served.setdefault(w.model, set()).update(_SERVES.get(w.role, set()))
    dropped = [
        m
        for m in plan.moves
        if m.model in short
        and _takes_from(m, short[m.model])
        and _feeds_only_heard(m, short[m.model], served.get(m.model, set()))
    ]
    why = f"{len(dropped)} moves held: they take capacity from a phase measured short"
    return _holding(plan, decision, dropped, why)


def _holding(
    plan: Plan, decision: HysteresisDecision, held: Sequence[Move], why: str
) -> tuple[Plan, HysteresisDecision]:
    """``plan`` less the ``held`` moves, the decision's reason saying why; nothing is
    proposed once every move is held."""
    if not held:
        return plan, decision
    kept = _only(plan, lambda m: m not in held)
    propose = decision.propose and bool(kept.moves)
    return kept, replace(decision, propose=propose, reason=f"{decision.reason}; {why}")


def _adds(m: Move, short: set[Phase]) -> bool:
    """A start of a worker serving a short phase, or a role change that keeps every short
    phase it served and adds one. A start for the other phase is left out: the boosted
    solve may re-balance the pools, but while one phase is short only it gets capacity (a
    decode shortage answered with prefill workers queued more hand-offs, issue 11)."""
    if m.kind is MoveKind.START:
        return m.target is not None and bool(_SERVES[m.target.role] & short)
    if m.kind is not MoveKind.ROLE_CHANGE or m.source is None or m.target is None:
        return False
    before, after = _SERVES[m.source.role] & short, _SERVES[m.target.role] & short
    return before <= after and bool(after - before)


def _floor_bound(inp: PlanningInput, current: Placement) -> set[str]:
    """Models whose worker floor keeps every worker they have (an owned fleet)."""
    counts: dict[str, int] = {}
    for w in current.workers:
        counts[w.model] = counts.get(w.model, 0) + 1
    return {
        m.arch.name
        for m in inp.models
        if m.min_workers > 0 and counts.get(m.arch.name, 0) <= m.min_workers
    }


def _spare_counts(a: SloAssessment) -> dict[Phase, int]:
    """How many workers each phase may give to the other: none unless the measurements put
    the risk on one phase only; then the other phase's measured spare (``SloAssessment``)."""
    if not a.one_phase_short:
        return {}
    if a.prefill_short:
        return {Phase.DECODE: a.decode_spare}
    return {Phase.PREFILL: a.prefill_spare}


def _within_spare(
    moves: tuple[Move, ...], short: set[Phase], spare: Mapping[str, dict[Phase, int]]
) -> tuple[Move, ...]:
    """``moves`` less the role changes ``spare`` does not cover: for each model in ``spare``
    (an owned fleet at risk), a role change is kept, in plan order, while every phase its
    worker leaves can still spare one more worker. Starts and other models' moves pass."""
    left = {name: dict(counts) for name, counts in spare.items()}
    kept = []
    for m in moves:
        if m.kind is MoveKind.ROLE_CHANGE and m.source is not None and m.model in left:
            counts = left[m.model]
            leaves = _SERVES[m.source.role] - short
            if not all(counts.get(p, 0) > 0 for p in leaves):
                continue
            for p in leaves:
                counts[p] -= 1
        kept.append(m)
    return tuple(kept)


def _kept_source(m: Move) -> Move:
    """A move of a worker becomes a start of a new one where the move would have gone.

    The best placement for the boosted demand may prefer another GPU kind for a worker that
    already serves (a cheaper kind, once enough of them are needed); while the SLO is at risk
    nothing serving is taken away, so the source keeps serving and the destination is added."""
    if m.kind not in (MoveKind.COLD_START, MoveKind.MIGRATE) or m.target is None:
        return m
    target = replace(m.target, worker_id=None, live_sessions=0, kv_used_tokens=0)
    return replace(
        m,
        kind=MoveKind.START,
        source=None,
        target=target,
        expected_pause_s=0.0,
        sessions_affected=0,
        reason=f"start {target.role.value} {target.gpu_kind} x{target.tp} on {target.node} "
        f"(capacity back; {m.source.node if m.source else 'the source'} keeps serving)",
    )


def _stopped(current: Placement, plan: Plan) -> Placement:
    """``current`` without the workers ``plan`` stops."""
    gone = {id(m.source) for m in plan.moves if m.kind is MoveKind.STOP and m.source}
    return Placement(tuple(w for w in current.workers if id(w) not in gone))


def _only(plan: Plan, keep: Callable[[Move], bool]) -> Plan:
    return replace(plan, moves=tuple(m for m in plan.moves if keep(m)))


def recent_lengths(
    d: ModelDemand,
    arrivals: tuple[np.ndarray, np.ndarray, np.ndarray],
    now: float,
    loop: LoopConfig,
) -> ModelDemand:
    """``d`` with the request lengths of the last ``loop.recent_s`` when the mix has shifted.

    The traffic window (5 minutes) averages request lengths over its whole span, so after a
    service shift (short chat prompts, then long documents) the planner sized and split the
    fleet for a blend that no longer arrives, for as long as the old requests stayed in the
    window: a fleet sized for the old prompts fell short on TTFT, and an owned fleet's decode
    pool, sized for the KV of short prompts, blocked on the long ones (issue 11's diagnosis
    on shifting mixes). Lengths move with the mix and not with bursts, so when the recent
    part of the window differs from the older part beyond noise, the demand's lengths are
    scaled by recent / window (the scale keeps what worker counters corrected). The rate
    stays the window's: bursts are the burst sizer's.
    """
    times, prompts, outputs = arrivals
    if d.arrival_rate_per_s <= 0 or times.size == 0:
        return d
    recent = times >= now - loop.recent_s
    n_new = int(recent.sum())
    n_old = int(times.size) - n_new
    if min(n_new, n_old) < loop.shift_min_requests:
        return d
    shifted = any(
        _differs(values[recent], values[~recent], loop.shift_z) for values in (prompts, outputs)
    )
    if not shifted:
        return d
    scale_p = float(prompts[recent].mean()) / max(float(prompts.mean()), 1e-9)
    scale_o = float(outputs[recent].mean()) / max(float(outputs.mean()), 1e-9)
    return replace(
        d,
        mean_prompt_tokens=max(1.0, d.mean_prompt_tokens * scale_p),
        mean_output_tokens=max(1.0, d.mean_output_tokens * scale_o),
    )


def _differs(new: np.ndarray, old: np.ndarray, z: float) -> bool:
    """The two samples' means differ by more than ``z`` standard errors of their difference."""
    se = math.sqrt(float(new.var()) / new.size + float(old.var()) / old.size)
    gap = abs(float(new.mean()) - float(old.mean()))
    return gap > z * se if se > 0 else gap > 0


def _colocated(inp: PlanningInput, models: Mapping[str, ModelDemand]) -> PlanningInput:
    """``inp`` with ``models`` planned as mixed workers only (where mixed is allowed)."""
    specs = tuple(
        replace(m, roles=(Role.MIXED,))
        if m.arch.name in models and Role.MIXED in m.roles and m.roles != (Role.MIXED,)
        else m
        for m in inp.models
    )
    if specs == inp.models:
        return inp
    return replace(inp, models=specs)


def _peaks_scaled(
    inp: PlanningInput, models: Mapping[str, ModelDemand], share: float
) -> PlanningInput:
    """``inp`` with each of ``models``' peak factors at ``share`` of its excess over 1."""
    demand = dict(inp.demand)
    for name, d in models.items():
        demand[name] = replace(
            d,
            prefill_peak_factor=1.0 + share * (d.prefill_peak_factor - 1.0),
            decode_peak_factor=1.0 + share * (d.decode_peak_factor - 1.0),
        )
    return replace(inp, demand=demand)


def _scaled(inp: PlanningInput, factors: Mapping[str, float]) -> PlanningInput:
    demand = dict(inp.demand)
    for name, f in factors.items():
        d = demand[name]
        demand[name] = replace(d, arrival_rate_per_s=d.arrival_rate_per_s * f)
    return replace(inp, demand=demand)


def _served_share(planner: Planner, inp: PlanningInput, current: Placement) -> float:
    """What the model predicts: the share of offered requests the placement serves in SLO."""
    rate = sum(d.arrival_rate_per_s for d in inp.demand.values())
    if rate <= 0:
        return 1.0
    served = planner.evaluate(inp, current).served_requests_per_s
    return min(1.0, sum(served.values()) / rate)


def restart_s(perf: PerfModel, inp: PlanningInput, model: str, costs: MoveCostModel) -> float:
    """Seconds to bring one worker of ``model`` back (a start: weights from storage, warm-up);
    the slowest shape the fleet could run, since any of them may be the one retired."""
    spec = next(m for m in inp.models if m.arch.name == model)
    worst = costs.cold_start_s
    for node in inp.nodes:
        for tp in spec.tp_options:
            for dtype in spec.dtypes:
                try:
                    nbytes = perf.weight_bytes(Deployment(spec.arch, node.gpu, tp, dtype))
                except UnsupportedDeployment:
                    continue
                worst = max(worst, nbytes / (costs.storage_gbps * 1e9) + costs.cold_start_s)
    return worst
