"""The FleetShift policy in the simulator: the daemon's own router, traffic monitor, output
estimator and planner, driven by simulated time instead of the wall clock.

Nothing here re-implements a decision: every request goes through ``core.routing.Router`` with
the loads the instances have at that instant (as if heartbeats were instantaneous, the same
freshness the least-loaded baseline enjoys), and the placement comes from the planner given
the traffic monitor's view of the recent mix. What the simulator adds is the price of acting
on a plan: each move takes its instance out of service for the move's cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fleetshift_daemon.core import planner as pl
from fleetshift_daemon.core import plans
from fleetshift_daemon.core import routing as rt
from fleetshift_daemon.core.burst import BurstConfig, BurstSizer, phase_need, with_need
from fleetshift_daemon.core.estimator import OutputLengthEstimator
from fleetshift_daemon.core.fleet import WorkerCounters
from fleetshift_daemon.core.planning_cycle import (
    LoopConfig,
    PlanningCycle,
    demand_from_traffic,
    restart_s,
)
from fleetshift_daemon.core.slo_monitor import (
    KV_BLOCK_TOKENS,
    SloMonitor,
    SloMonitorConfig,
    SloThresholds,
    sample_from_counters,
)
from fleetshift_daemon.core.traffic import TrafficConfig, TrafficMonitor
from fleetshift_daemon.sim.engine import Instance, Role, Simulator
from fleetshift_daemon.sim.metrics import unloaded_times
from fleetshift_daemon.sim.policies import least_busy, observed_mix

_TO_RT = {Role.MIXED: rt.Role.MIXED, Role.PREFILL: rt.Role.PREFILL, Role.DECODE: rt.Role.DECODE}
_FROM_RT = {v: k for k, v in _TO_RT.items()}
_ROUTABLE_PAUSE_S = 5.0  # a pause longer than this (a start, a move) takes it off the router


# The simulator's solver limits: a node limit instead of the daemon's 1 s wall clock, so a
# replay decides the same on a loaded host as on a quiet one. 10,000 nodes is ~50x the most
# any solve took on the tuning cells (176; most settle at the root); the 120 s backstop only
# guards a pathological solve (should it ever bind, that run depends on the host again).
SIM_NODE_LIMIT = 10_000
SIM_TIME_LIMIT_S = 120.0


def simulated_planner_config(sim: Simulator, config: pl.PlannerConfig | None) -> pl.PlannerConfig:
    """The daemon's planner settings for a simulated fleet: its batch cap, and limits that
    do not read the wall clock (a run must not depend on how busy the host is)."""
    return dataclasses.replace(
        config or pl.PlannerConfig(),
        max_decode_batch=sim.config.max_batch,
        node_limit=SIM_NODE_LIMIT,
        time_limit_s=SIM_TIME_LIMIT_S,
        retry_time_limit_s=SIM_TIME_LIMIT_S,
    )


class SimClock:
    """The simulated time, as the clock the daemon's components are injected with."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker_id(inst: Instance) -> str:
    return f"w{inst.idx}"


class RouterPolicy:
    """Routing by the daemon's soft-score router over the instances' current roles."""

    name = "router"
    tick_s: float | None = None

    def __init__(self, hindsight_outputs: bool = False, seed: int = 0) -> None:
        self.hindsight_outputs = hindsight_outputs
        self.seed = seed
        self.clock = SimClock()
        self._router: rt.Router | None = None
        self._by_id: dict[str, Instance] = {}
        self._decode_of: dict[int, int] = {}
        self._slo: tuple[np.ndarray, np.ndarray] | None = None
        self.estimator: OutputLengthEstimator | None = None
        self.traffic: TrafficMonitor | None = None
        self._roles_seen: tuple[Role, ...] = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> RouterPolicy:
        # The router and monitor hold locks and cannot be copied; a copy rebuilds them.
        clone = type(self).__new__(type(self))
        clone.__dict__.update(
            {k: v for k, v in self.__dict__.items() if k not in ("_router", "traffic")}
        )
        clone.clock = SimClock()
        clone.clock.now = self.clock.now
        clone._router = None
        clone.traffic = None
        clone._decode_of = dict(self._decode_of)
        clone._roles_seen = ()
        return clone

    # -- plumbing ---------------------------------------------------------------------------
    def _ensure(self, sim: Simulator) -> rt.Router:
        # A starting instance (loading weights) is not routable until it serves, as a
        # starting worker is not in the daemon's view until it registers ready.
        now = sim.now
        roles = tuple(
            Role.OFF if i.paused_until > now + _ROUTABLE_PAUSE_S else i.role for i in sim.instances
        )
        if self._router is None:
            self._slo = unloaded_times(sim) if self._slo is None else self._slo
            link = sim.fleet.internode_gbps_per_gpu * min(g.tp for g in sim.fleet.groups)
            self._router = rt.Router(
                sim.model,
                [sim.fleet.arch],
                estimator=None if self.hindsight_outputs else self.estimator,
                traffic=self.traffic,
                config=rt.RouterConfig(
                    kv_link_gbps=link,
                    seed=self.seed,
                ),
            )
            self._roles_seen = ()
        if roles != self._roles_seen:
            serving = [i for i, r in zip(sim.instances, roles, strict=True) if r is not Role.OFF]
            self._router.update_fleet([self._view(sim, i) for i in serving])
            self._by_id = {worker_id(i): i for i in serving}
            self._roles_seen = roles
        return self._router

    def _view(self, sim: Simulator, inst: Instance) -> rt.WorkerView:
        return rt.WorkerView(
            id=worker_id(inst),
            node=f"n{inst.node}",
            model=sim.fleet.arch.name,
            role=_TO_RT[inst.role],
            gpu=inst.dep.gpu,
            tp=inst.dep.tp,
            dtype=inst.dep.dtype,
            kv_total_tokens=inst.kv_cap,
        )

    def setup(self, sim: Simulator) -> None:
        self.clock.now = 0.0
        self._ensure(sim)

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        self.clock.now = t
        router = self._ensure(sim)
        for inst in self._by_id.values():
            router.update_load(
                worker_id(inst),
                queue_tokens=inst.queue_tokens,
                kv_used_tokens=inst.kv_used,
                live_sessions=inst.batch + len(inst.handoff) + inst.kv_incoming,
            )
        assert self._slo is not None
        u_ttft, u_tbt = self._slo
        slo = sim.fleet.slo
        decision = router.route(
            rt.RouteRequest(
                model=sim.fleet.arch.name,
                prompt_tokens=int(sim.prompt[req]),
                expected_output_tokens=int(sim.output[req]) if self.hindsight_outputs else None,
                slo=rt.Slo(
                    ttft_ms=float(u_ttft[req]) * slo.ttft_multiple * 1e3,
                    tbt_ms=float(u_tbt[req]) * slo.tbt_multiple * 1e3,
                ),
            )
        )
        inst = self._by_id[decision.worker_id]
        if decision.decode_worker_id is not None:
            self._decode_of[req] = self._by_id[decision.decode_worker_id].idx
        return inst

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance:
        idx = self._decode_of.pop(req, None)
        if idx is not None and sim.instances[idx].role in (Role.MIXED, Role.DECODE):
            return sim.instances[idx]
        pool = [i for i in sim.instances if i.role in (Role.MIXED, Role.DECODE)]
        ready = [i for i in pool if i.paused_until <= t + _ROUTABLE_PAUSE_S]
        pool = ready or pool
        rates = {i.idx: 1.0 for i in pool}
        return least_busy(sim, pool, req, t, rates) or src

    def on_tick(self, sim: Simulator, t: float) -> None:
        return None


def node_name(node: int) -> str:
    return f"n{node}"


def planner_nodes(sim: Simulator) -> list[pl.NodeCapacity]:
    seen: dict[int, pl.NodeCapacity] = {}
    for inst in sim.instances:
        if inst.node not in seen:
            seen[inst.node] = pl.NodeCapacity(node_name(inst.node), inst.dep.gpu, inst.group.gpus)
    return list(seen.values())


def model_spec(sim: Simulator, keep_all: bool = False) -> pl.ModelSpec:
    """``keep_all``: an owned fleet, every instance serves (the planner only picks roles)."""
    tps = tuple(sorted({g.tp for g in sim.fleet.groups}))
    return pl.ModelSpec(
        sim.fleet.arch,
        dtypes=(sim.fleet.dtype,),
        tp_options=tps,
        min_workers=len(sim.instances) if keep_all else 0,
    )


def current_placement(sim: Simulator) -> pl.Placement:
    workers = []
    for inst in sim.instances:
        if inst.role is Role.OFF:
            continue
        workers.append(
            pl.PlacedWorker(
                model=sim.fleet.arch.name,
                role=_TO_RT[inst.role],
                gpu_kind=inst.gpu,
                tp=inst.dep.tp,
                dtype=inst.dep.dtype,
                node=node_name(inst.node),
                worker_id=worker_id(inst),
                live_sessions=inst.batch,
                kv_used_tokens=inst.kv_used,
            )
        )
    return pl.Placement(tuple(workers))


def slo_target(sim: Simulator, mean_prompt: float, mean_output: float) -> pl.SloTarget:
    """The planner's SLO: the multiples of the unloaded times of the window's mean request."""
    dep = sim.fleet.reference_deployment(sim.model)
    p = max(1, round(mean_prompt))
    ttft = sim.model.prefill_time_s(dep, [p])
    tbt = sim.model.decode_step_time_s(dep, 1, p + max(1, round(mean_output)) // 2)
    slo = sim.fleet.slo
    return pl.SloTarget(ttft_ms=ttft * slo.ttft_multiple * 1e3, tbt_ms=tbt * slo.tbt_multiple * 1e3)


def planning_input_for(
    sim: Simulator, demand: pl.ModelDemand, keep_all: bool = False
) -> pl.PlanningInput:
    name = sim.fleet.arch.name
    return pl.planning_input(
        planner_nodes(sim),
        [model_spec(sim, keep_all)],
        [demand],
        slos={name: slo_target(sim, demand.mean_prompt_tokens, demand.mean_output_tokens)},
    )


def target_roles(sim: Simulator, placement: pl.Placement) -> list[Role]:
    """Roles per instance for a planner placement; instances it does not use are OFF."""
    roles = [Role.OFF] * len(sim.instances)
    by_id = {worker_id(i): i for i in sim.instances}
    new: list[pl.PlacedWorker] = []
    for w in placement.workers:
        inst = by_id.get(w.worker_id or "")
        if inst is not None:
            roles[inst.idx] = _FROM_RT[w.role]
        else:
            new.append(w)
    for w in new:  # a new worker: an instance of that node and TP not otherwise used
        for inst in sim.instances:
            if (
                roles[inst.idx] is Role.OFF
                and node_name(inst.node) == w.node
                and inst.dep.tp == w.tp
            ):
                roles[inst.idx] = _FROM_RT[w.role]
                break
    return roles


def demand_of(sim: Simulator, start_s: float, end_s: float) -> pl.ModelDemand:
    mix = observed_mix(sim, start_s, end_s)
    return pl.ModelDemand(sim.fleet.arch.name, mix.rate_per_s, mix.mean_prompt, mix.mean_output)


class FleetShift(RouterPolicy):
    """Router + traffic monitor + the daemon's planning cycle, driven in simulated time.

    Every ``heartbeat_s`` the simulated workers report what an agent's heartbeat carries
    (token counters, queue depth, live sessions, TTFT/TBT p50 and p99 over the interval) to
    the daemon's own traffic monitor and SLO monitor. Every ``tick_s`` (or at the next
    heartbeat once the SLO monitor says the SLO is at risk) runs one pass of the daemon's
    periodic job (``core.planning_cycle``): the traffic window (burst-sized) becomes demand,
    the planner solves for the best placement, efficiency is published and the gate (or the
    measured loop) decides whether the plan is proposed. A proposed plan is acted out
    make-before-break (see ``plan_orders``).
    """

    name = "fleetshift"

    def __init__(
        self,
        tick_s: float = 60.0,
        window_s: float = 300.0,
        deploy_window_s: float = 300.0,
        seed: int = 0,
        keep_all: bool = False,
        hysteresis: plans.HysteresisConfig | None = None,
        costs: plans.MoveCostModel | None = None,
        planner_config: pl.PlannerConfig | None = None,
        heartbeat_s: float = 10.0,
        burst: BurstConfig | None = None,
        slo_monitor: SloMonitorConfig | None = None,
        loop: LoopConfig | None = None,
        closed_loop: bool = True,
    ) -> None:
        super().__init__(hindsight_outputs=False, seed=seed)
        self.planner_config = planner_config
        self.plan_s = tick_s
        self.tick_s = min(heartbeat_s, tick_s) if closed_loop else tick_s
        self.window_s = window_s
        self.deploy_window_s = deploy_window_s
        self.keep_all = keep_all
        if keep_all:
            self.name = "fleetshift-all"
        self.hysteresis = hysteresis
        self.costs = costs or plans.MoveCostModel()
        self.burst_config = burst or BurstConfig()
        self.slo_config = slo_monitor or SloMonitorConfig()
        self.loop = loop
        self.closed_loop = closed_loop
        self.decisions: list[tuple[float, str]] = []
        self.measured: list[tuple[float, float | None, float]] = []  # t, measured, predicted
        self._fed_until = 0.0
        self._last_plan = -math.inf
        self._slo_ms = (1.0, 1.0)

    def setup(self, sim: Simulator) -> None:
        self.traffic = TrafficMonitor(self.clock, TrafficConfig(window_s=self.window_s))
        self.estimator = OutputLengthEstimator()
        self.slo = SloMonitor(self.clock, self.slo_config) if self.closed_loop else None
        planner = pl.Planner(sim.model, simulated_planner_config(sim, self.planner_config))
        gate = plans.Hysteresis(self.clock, self.hysteresis)
        sizer = BurstSizer(self.clock, self.burst_config) if self.closed_loop else None
        self.cycle = PlanningCycle(
            planner,
            sim.model,
            gate,
            self.costs,
            clock=self.clock,
            traffic=self.traffic,
            burst=sizer,
            slo_monitor=self.slo,
            loop=self.loop,
        )
        # Deploy time: the planner's best placement for the first window's mix (sized for its
        # bursts), the same knowledge the static split is deployed with. Free: nothing is
        # running yet.
        inp = self._deploy_input(sim)
        solution = self.cycle.best(inp, pl.Placement())[1]
        for inst, role in zip(sim.instances, target_roles(sim, solution.placement), strict=True):
            inst.role = role
            if role is Role.OFF:
                inst.bill_start = None
        super().setup(sim)

    def _deploy_input(self, sim: Simulator) -> pl.PlanningInput:
        demand = demand_of(sim, 0.0, self.deploy_window_s)
        inp = planning_input_for(sim, demand, self.keep_all)
        self._slo_ms = (inp.slo(demand.model).ttft_ms, inp.slo(demand.model).tbt_ms)
        if not self.closed_loop or demand.arrival_rate_per_s <= 0:
            return inp
        window = sim.trace.window(0.0, self.deploy_window_s)
        arrivals = (
            window.arrival_s,
            window.prompt_tokens.astype(float),
            window.output_tokens.astype(float),
        )
        restart = restart_s(sim.model, inp, demand.model, self.costs)
        need = phase_need(
            arrivals,
            self.deploy_window_s,
            self.deploy_window_s,
            inp.slo(demand.model),
            restart,
            self.burst_config,
        )
        sized = with_need(demand, need, self.burst_config.max_factor)
        return self.cycle.within_fleet(dataclasses.replace(inp, demand={demand.model: sized}))

    def _heartbeat(self, sim: Simulator, t: float) -> None:
        """What the agents would report: completions (for the estimator), and each worker's
        counters (tokens, queue, KV blocks, sessions, latency percentiles over the interval),
        read by the traffic and SLO monitors as the daemon reads a real heartbeat."""
        assert self.estimator is not None and self.traffic is not None
        fin = sim.log.finish_s
        done = np.flatnonzero((fin > self._fed_until) & (fin <= t))
        name = sim.fleet.arch.name
        for req in done[np.argsort(fin[done], kind="stable")]:
            self.estimator.observe_completion(name, int(sim.prompt[req]), int(sim.output[req]))
        counters = self._counters(sim, self._fed_until, t, done)
        for c in counters.values():
            self.traffic.observe_counters(c.worker_id, name, c.prefill_tokens, c.decode_tokens)
        if self.slo is not None:
            self.slo.observe(
                # a worker draining on its way out still reports what it finishes
                sample_from_counters(c, name, _TO_RT.get(inst.role, rt.Role.MIXED))
                for inst, c in counters.items()
                if not (inst.role is Role.OFF and inst.idle)
            )
        self._fed_until = t

    def _counters(
        self, sim: Simulator, since: float, t: float, done: np.ndarray
    ) -> dict[Instance, WorkerCounters]:
        """Per worker, the counters a real worker's heartbeat carries (``WorkerCounters``).

        As vLLM reports them: the queue is the requests waiting, prompts not yet admitted
        *and* hand-offs waiting on a decode worker for KV memory (issue 11: counting only
        un-prefilled prompt tokens hid every decode-side backlog, so each growing queue read
        as a prefill shortage); KV blocks used and total; sessions running or waiting.
        Latencies: TTFT of the prompts it prefilled and TBT of the requests it finished in
        ``(since, t]``. Each simulated request has its own SLO (multiples of its unloaded
        times), so a latency is reported as its share of the request's own SLO times the
        planner's SLO for the window's mean request: the monitor judges both alike."""
        assert self._slo is not None
        u_ttft, u_tbt = self._slo
        mult = sim.fleet.slo
        log = sim.log
        ft = log.first_token_s
        first = np.flatnonzero((ft > since) & (ft <= t))
        ttft = (ft[first] - sim.trace.arrival_s[first]) / (u_ttft[first] * mult.ttft_multiple)
        multi = done[sim.output[done] > 1]
        tbt = (log.finish_s[multi] - ft[multi]) / (sim.output[multi] - 1)
        tbt = tbt / (u_tbt[multi] * mult.tbt_multiple)
        pre_of, dec_of = log.prefill_inst[first], log.decode_inst[multi]
        ttft_ms, tbt_ms = self._slo_ms
        out = {}
        for inst in sim.instances:
            mine_t, mine_d = ttft[pre_of == inst.idx], tbt[dec_of == inst.idx]
            tp = np.percentile(mine_t, [50, 99]) * ttft_ms if mine_t.size else (0.0, 0.0)
            dp = np.percentile(mine_d, [50, 99]) * tbt_ms if mine_d.size else (0.0, 0.0)
            waiting = len(inst.waiting) + len(inst.handoff)
            out[inst] = WorkerCounters(
                worker_id(inst),
                prefill_tokens=inst.prefill_tokens_done,
                decode_tokens=inst.decode_tokens_done,
                queue_depth=waiting,
                kv_blocks_used=math.ceil(inst.kv_used / KV_BLOCK_TOKENS),
                kv_blocks_total=inst.kv_cap // KV_BLOCK_TOKENS,
                live_sessions=inst.batch + inst.kv_incoming + len(inst.ready) + waiting,
                ttft_p50_ms=float(tp[0]),
                ttft_p99_ms=float(tp[1]),
                tbt_p50_ms=float(dp[0]),
                tbt_p99_ms=float(dp[1]),
            )
        return out

    def on_tick(self, sim: Simulator, t: float) -> None:
        self.clock.now = t
        self._heartbeat(sim, t)
        assert self.traffic is not None
        due = t - self._last_plan >= self.plan_s - 1e-9
        if not due and not self._at_risk(sim):
            return
        demand = demand_from_traffic(self.traffic, [sim.fleet.arch.name])[0]
        if demand.arrival_rate_per_s <= 0:
            return
        self._last_plan = t
        inp = planning_input_for(sim, demand, self.keep_all)
        self._slo_ms = (inp.slo(demand.model).ttft_ms, inp.slo(demand.model).tbt_ms)
        report = self.cycle.run(inp, current_placement(sim))
        sim.efficiency.append((t, report.efficiency))
        self.measured.append((t, report.measured_attainment, report.predicted_attainment))
        if not report.decision.propose:
            return
        self.decisions.append((t, report.decision.reason))
        for idx, role, kind, cost, delay in plan_orders(sim, report.plan):
            inst = sim.instances[idx]
            if delay <= 0:
                sim.set_role(inst, role, t, kind, cost)
            else:
                sim.schedule(t + delay, _later(sim, inst, role, kind, cost))

    def _at_risk(self, sim: Simulator) -> bool:
        if self.slo is None:
            return False
        ttft_ms, tbt_ms = self._slo_ms
        return self.slo.assess(sim.fleet.arch.name, SloThresholds(ttft_ms, tbt_ms)).at_risk


# instance, new role, kind of move, seconds out of service, delay before it takes effect
MoveOrder = tuple[int, Role, str, float, float]


def plan_orders(sim: Simulator, plan: plans.Plan) -> list[MoveOrder]:
    """A plan's moves as instance role changes, played make-before-break.

    A new or moved worker's instance is billed and out of service for the move's duration;
    the instance it replaces keeps serving until then and only then stops taking work (it
    finishes what it holds). Role changes and stops wait for every start and move, the order
    the daemon's executor runs a plan's steps in (``MovePlanner.plan_steps``); a role change
    then takes its instance out for the change's duration. Sessions of a moved worker are not
    carried over in the simulation: they finish where they are (a drain, not a KV recompute).
    """
    by_id = {worker_id(i): i for i in sim.instances}
    claimed: set[int] = set()
    orders: list[MoveOrder] = []
    last_up = max(
        (
            m.duration_s
            for m in plan.moves
            if m.kind not in (plans.MoveKind.STOP, plans.MoveKind.ROLE_CHANGE)
        ),
        default=0.0,
    )
    for m in plan.moves:
        src = by_id.get(m.source.worker_id or "") if m.source else None
        if m.kind is plans.MoveKind.ROLE_CHANGE and src is not None and m.target is not None:
            # as the daemon orders a plan's steps: new capacity first, role changes after it
            orders.append((src.idx, _FROM_RT[m.target.role], m.kind.value, m.duration_s, last_up))
            continue
        if m.kind is plans.MoveKind.STOP:
            if src is not None:
                orders.append((src.idx, Role.OFF, m.kind.value, 0.0, last_up))
            continue
        assert m.target is not None
        dst = _free_instance(sim, m.target, claimed)
        if dst is None:
            continue
        claimed.add(dst.idx)
        orders.append((dst.idx, _FROM_RT[m.target.role], m.kind.value, m.duration_s, 0.0))
        if src is not None:
            orders.append((src.idx, Role.OFF, "retire", 0.0, m.duration_s))
    return orders


def _free_instance(sim: Simulator, w: pl.PlacedWorker, claimed: set[int]) -> Instance | None:
    for inst in sim.instances:
        if (
            inst.role is Role.OFF
            and inst.idx not in claimed
            and node_name(inst.node) == w.node
            and inst.dep.tp == w.tp
        ):
            return inst
    return None


def _later(
    sim: Simulator, inst: Instance, role: Role, kind: str, cost: float
) -> Callable[[float], None]:
    def act(t: float) -> None:
        sim.set_role(inst, role, t, kind, cost)

    return act
