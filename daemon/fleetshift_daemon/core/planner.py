"""Decide how many prefill, decode and mixed workers of each model run on each GPU kind.

The planner answers "what is the best placement for the current mix?" so that the daemon can
publish how far the current placement is from it (the efficiency figure) and propose moves.

Formulation (``scipy.optimize.milp``, HiGHS). One *option* is a worker shape: (model, role,
GPU kind, TP, dtype). Its capacity per phase comes from the performance model at the batch
that keeps the SLO: decode tokens/s at the largest batch whose step time stays within the TBT
SLO and whose KV fits; prefill tokens/s at the largest prompt batch whose pass fits in a
fraction of the TTFT SLO (the rest is queueing headroom), both derated to a utilisation
target. A mixed worker time-shares both phases (``x_p/P + x_d/D <= n * mixed_efficiency``,
the efficiency standing for prefill chunks stalling decode steps). Integer worker counts per
option; per GPU kind the GPUs used by workers of TP >= t must fit in what the kind's nodes
offer in whole groups of t (a TP group never spans nodes). Served requests per model are
bounded by the arrival rate and by the prefill and decode tokens/s its workers deliver (the
KV hand-off between split pools is not charged: Splitwise measured it at 0.8 % of latency); the
objective is goodput (tokens/s served within SLO) with $/hour as a tie-break (the whole fleet's
cost weighs ``cost_weight`` of the demand). The MILP searches integers in a box around the LP
relaxation (+/- ``integer_margin`` per count), stops within ``mip_rel_gap`` of (unserved demand
+ weighted cost) or at ``time_limit_s`` (or ``node_limit``) with its best placement; the LP
relaxation's goodput is reported beside it as an upper bound, so the quality of every answer
is visible.

Scale: the MILP is aggregated by GPU kind, so its size depends on models x kinds x TP x dtype
options, never on the node count; nodes enter only as capacity sums and in the assignment of
counts to concrete nodes, a greedy best-fit that first keeps existing workers where they are
(and their role where it is still wanted), then places the largest TP groups first on the
node of the kind with the least free GPUs that still fit (bucketed by free GPUs, so O(workers x
GPUs per node)). What the greedy cannot place is reported, never silently dropped.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp  # type: ignore[import-untyped]
from scipy.sparse import coo_matrix, csr_matrix, hstack  # type: ignore[import-untyped]

from fleetshift_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.errors import UnknownGpuKind, UnsupportedDeployment
from fleetshift_daemon.core.gpus import GpuKind
from fleetshift_daemon.core.perfmodel import Deployment, Dtype, ModelArch, PerfModel
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.traffic import TrafficStats

OptionKey = tuple[str, Role, str, int, Dtype]  # model, role, GPU kind name, tp, dtype


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    gpu: GpuKind
    gpu_count: int
    cordoned: bool = False


@dataclass(frozen=True)
class ModelSpec:
    arch: ModelArch
    dtypes: tuple[Dtype, ...] = (Dtype.BF16,)
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    min_workers: int = 0
    roles: tuple[Role, ...] = (Role.PREFILL, Role.DECODE, Role.MIXED)


@dataclass(frozen=True)
class ModelDemand:
    model: str
    arrival_rate_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    # Burst-aware sizing (``core.burst``): the capacity each phase needs per served request,
    # over what its mean length asks for. A fleet sized at 1.0 keeps up with the mean and
    # queues through every burst; the factors come from the arrival process the window saw.
    prefill_peak_factor: float = 1.0
    decode_peak_factor: float = 1.0

    @classmethod
    def from_stats(cls, stats: TrafficStats) -> ModelDemand:
        """Offered load: the arrival rate and the lengths the requests asked for.

        Worker counters can only raise a length: when the fleet processed more tokens per
        request than the router was told (outputs were estimated too short), the processed
        figure stands. They never lower it: a fleet that falls behind processes fewer tokens
        per request than arrive, and planning for that would hide the overload it should fix.
        """
        rate = stats.arrival_rate_per_s
        prompt, output = stats.prompt.mean, stats.output.mean
        if stats.source == "counters" and rate > 0:
            prompt = max(prompt, stats.prefill_tokens_per_s / rate)
            output = max(output, stats.decode_tokens_per_s / rate)
        return cls(stats.model, rate, max(prompt, 1.0), max(output, 1.0))


@dataclass(frozen=True)
class SloTarget:
    ttft_ms: float = 2000.0
    tbt_ms: float = 100.0


@dataclass(frozen=True)
class PlannerConfig:
    # Headroom. The defaults were calibrated with the simulator (docs/bench-sim.md, "Planner
    # headroom"): at 0.8 and a decode step at the full TBT SLO the planner sized fleets that
    # met its own model and missed the SLO by queueing and prefill stalls the model leaves out.
    utilisation: float = 0.5  # capacities are derated to this, leaving queueing headroom
    # A mixed worker's share of a dedicated one's capacity. 0.925 since Round 12b
    # (docs/bench-sim.md): chosen on issue 11's tuning cells only, among 0.85 (the old value,
    # never measured), 0.9, 0.925, 0.95 and 1.0, by a rule written before those runs. Lower,
    # the planner buys phase splits that lose to colocation under bursts and overload; higher,
    # it stops splitting where a split is what serves a shifted mix.
    mixed_efficiency: float = 0.925
    prefill_budget_fraction: float = 0.5  # of the TTFT SLO one prefill pass may take
    decode_slack_fraction: float = 0.2  # of the slack between an unloaded step and TBT SLO
    max_decode_batch: int = 256
    max_prefill_batch: int = 64
    mip_rel_gap: float = 1e-2  # of (unserved demand + weighted cost), see _Lp._run
    time_limit_s: float = 1.0  # HiGHS then returns its best placement so far (see status)
    # A solve stopped by time_limit_s before it found any placement is tried once more with
    # this limit: on a loaded host the 1 s can run out before presolve ends, and "no
    # placement" would then read as an impossible fleet (FailedPrecondition naming
    # min_workers) when it is only a slow one.
    retry_time_limit_s: float = 30.0
    # Branch-and-bound nodes HiGHS may explore (None: no limit). A wall-clock limit makes the
    # answer depend on how loaded the host is; a node limit does not. The simulator sets one
    # (and a long wall-clock backstop) so a replay gives the same decisions on a busy host as
    # on a quiet one; the daemon keeps its 1 s, where an answer in time matters more.
    node_limit: int | None = None
    # The whole fleet's $/hour is worth this fraction of the demanded goodput in the objective:
    # goodput decides, cost breaks ties between placements within that fraction.
    cost_weight: float = 1e-3
    integer_margin: int = 2  # the MILP searches each count within LP value -/+ this

    def __post_init__(self) -> None:
        for name in (
            "utilisation",
            "mixed_efficiency",
            "prefill_budget_fraction",
            "decode_slack_fraction",
        ):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidArgument(f"{name} must be in (0, 1]", field=name)
        if self.node_limit is not None and self.node_limit < 1:
            raise InvalidArgument("node_limit must be >= 1 (or None)", field="node_limit")


@dataclass(frozen=True)
class OptionCapacity:
    key: OptionKey
    gpu: GpuKind
    prefill_tokens_per_s: float  # per worker, 0 when the role does not prefill
    decode_tokens_per_s: float
    decode_batch: int
    gpus: int

    @property
    def model(self) -> str:
        return self.key[0]

    @property
    def role(self) -> Role:
        return self.key[1]

    @property
    def tp(self) -> int:
        return self.key[3]

    @property
    def cost_per_hour(self) -> float:
        return self.gpus * self.gpu.price_per_hour


@dataclass(frozen=True)
class PlacedWorker:
    model: str
    role: Role
    gpu_kind: str
    tp: int
    dtype: Dtype
    node: str
    worker_id: str | None = None
    live_sessions: int = 0
    kv_used_tokens: int = 0

    @property
    def key(self) -> OptionKey:
        return (self.model, self.role, self.gpu_kind, self.tp, self.dtype)


@dataclass(frozen=True)
class Placement:
    workers: tuple[PlacedWorker, ...] = ()

    def counts(self) -> Counter[OptionKey]:
        return Counter(w.key for w in self.workers)


@dataclass(frozen=True)
class Evaluation:
    goodput_tokens_per_s: float
    demand_tokens_per_s: float
    served_requests_per_s: Mapping[str, float] = field(hash=False)
    cost_per_hour: float
    gpus_used: int


@dataclass(frozen=True)
class Solution:
    placement: Placement
    counts: Mapping[OptionKey, int] = field(hash=False)
    evaluation: Evaluation
    unplaced: tuple[OptionKey, ...]
    solve_s: float
    status: str  # "optimal" (within mip_rel_gap) or "feasible (...time limit...)"
    goodput_bound_tokens_per_s: float  # LP relaxation: no placement can beat it


@dataclass(frozen=True)
class EfficiencyReport:
    efficiency: float  # current goodput / best goodput, 1.0 when optimal
    current: Evaluation
    best: Solution


@dataclass(frozen=True)
class PlanningInput:
    """Everything a solve needs, validated once."""

    nodes: tuple[NodeCapacity, ...]
    models: tuple[ModelSpec, ...]
    demand: Mapping[str, ModelDemand] = field(hash=False)
    slos: Mapping[str, SloTarget] = field(hash=False)
    default_slo: SloTarget = SloTarget()

    def slo(self, model: str) -> SloTarget:
        return self.slos.get(model, self.default_slo)


def planning_input(
    nodes: Iterable[NodeCapacity],
    models: Iterable[ModelSpec],
    demand: Iterable[ModelDemand],
    slos: Mapping[str, SloTarget] | None = None,
    default_slo: SloTarget | None = None,
) -> PlanningInput:
    node_t = tuple(nodes)
    model_t = tuple(models)
    names = set()
    for i, n in enumerate(node_t):
        if n.gpu_count < 0:
            raise InvalidArgument("gpu_count must be >= 0", field=f"nodes[{i}].gpu_count")
        if n.name in names:
            raise InvalidArgument(f"node {n.name!r} listed twice", field=f"nodes[{i}].name")
        names.add(n.name)
    model_names = {m.arch.name for m in model_t}
    for i, m in enumerate(model_t):
        if m.min_workers < 0:
            raise InvalidArgument("min_workers must be >= 0", field=f"models[{i}].min_workers")
        if not m.tp_options or any(t <= 0 for t in m.tp_options):
            raise InvalidArgument("tp_options must be positive", field=f"models[{i}].tp_options")
    dem: dict[str, ModelDemand] = {}
    for i, d in enumerate(demand):
        if d.model not in model_names:
            raise NotFound(f"demand for unknown model {d.model!r}", field=f"demand[{i}].model")
        for name in ("arrival_rate_per_s", "mean_prompt_tokens", "mean_output_tokens"):
            value = getattr(d, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{name} must be >= 0", field=f"demand[{i}].{name}")
        for name in ("prefill_peak_factor", "decode_peak_factor"):
            value = getattr(d, name)
            if not (math.isfinite(value) and value >= 1):
                raise InvalidArgument(f"{name} must be >= 1", field=f"demand[{i}].{name}")
        if d.arrival_rate_per_s > 0 and (d.mean_prompt_tokens <= 0 or d.mean_output_tokens <= 0):
            raise InvalidArgument(
                "mean lengths must be > 0 with traffic", field=f"demand[{i}].mean_prompt_tokens"
            )
        dem[d.model] = d
    slo_map = dict(slos or {})
    for name, s in slo_map.items():
        for f in ("ttft_ms", "tbt_ms"):
            if not getattr(s, f) > 0:
                raise InvalidArgument(f"slo.{f} must be > 0", field=f"slos[{name}].{f}")
    return PlanningInput(node_t, model_t, dem, slo_map, default_slo or SloTarget())


class Planner:
    def __init__(self, perf: PerfModel, config: PlannerConfig | None = None) -> None:
        self._perf = perf
        self._cfg = config or PlannerConfig()

    # -- capacities -------------------------------------------------------------------------

    def option_capacity(
        self, spec: ModelSpec, role: Role, gpu: GpuKind, tp: int, dtype: Dtype, inp: PlanningInput
    ) -> OptionCapacity | None:
        """Per-worker tokens/s of one shape at the SLO; None when it cannot run or meet it."""
        cfg = self._cfg
        dep = Deployment(spec.arch, gpu, tp, dtype)
        try:
            co = self._perf.coefficients(dep)
        except UnsupportedDeployment:
            return None
        d = inp.demand.get(spec.arch.name)
        prompt = d.mean_prompt_tokens if d and d.arrival_rate_per_s > 0 else 1024.0
        out = d.mean_output_tokens if d and d.arrival_rate_per_s > 0 else 256.0
        slo = inp.slo(spec.arch.name)
        cp = self._perf.correction(dep, Phase.PREFILL)
        cd = self._perf.correction(dep, Phase.DECODE)
        prefill_tps = decode_tps = 0.0
        batch = 0
        if role is not Role.DECODE:
            budget = slo.ttft_ms / 1e3 * cfg.prefill_budget_fraction / cp
            per_prompt = co.p_tok * prompt + co.p_sq * prompt * prompt + co.p_seq
            n = min(math.floor((budget - co.p0) / per_prompt), cfg.max_prefill_batch)
            # the closed form ignores the long-pass knee: step down until the pass fits
            while n >= 1 and co.prefill_s(n * prompt, n * prompt * prompt, n) > budget:
                n -= 1
            if n < 1:
                return None
            t = co.prefill_s(n * prompt, n * prompt * prompt, n) * cp
            prefill_tps = n * prompt / t * cfg.utilisation
        if role is not Role.PREFILL:
            ctx = prompt + out / 2.0
            per_seq = co.d_seq + co.d_ctx * ctx
            # a step may take the unloaded step time plus this fraction of the slack up to the
            # SLO; the rest absorbs prefill passes in between and queueing
            unloaded = co.decode_s(1, ctx)
            slack = slo.tbt_ms / 1e3 / cd - unloaded
            if slack < 0:
                return None
            step_budget = unloaded + cfg.decode_slack_fraction * slack
            b_slo = max(1, math.floor((step_budget - co.d0) / per_seq))
            b_kv = math.floor(co.kv_capacity_tokens / (prompt + out))
            batch = min(b_slo, b_kv, cfg.max_decode_batch)
            if batch < 1:
                return None
            t = co.decode_s(batch, batch * ctx) * cd
            decode_tps = batch / t * cfg.utilisation
        key: OptionKey = (spec.arch.name, role, gpu.name, tp, dtype)
        return OptionCapacity(key, gpu, prefill_tps, decode_tps, batch, tp)

    def options(self, inp: PlanningInput, extra: Iterable[OptionKey] = ()) -> list[OptionCapacity]:
        kinds = {n.gpu.name: n.gpu for n in inp.nodes}
        specs = {m.arch.name: m for m in inp.models}
        wanted: set[OptionKey] = set()
        for m in inp.models:
            for gpu in kinds.values():
                for tp in m.tp_options:
                    for dtype in m.dtypes:
                        for role in m.roles:
                            wanted.add((m.arch.name, role, gpu.name, tp, dtype))
        keep = set(extra)
        wanted.update(keep)
        out = []
        for key in sorted(wanted, key=_key_order):
            model, role, kind, tp, dtype = key
            if kind not in kinds:
                raise UnknownGpuKind(f"gpu kind {kind!r} is on no node", field="gpu_kind")
            if model not in specs:
                raise NotFound(f"model {model!r} is not planned", field="model")
            cap = self.option_capacity(specs[model], role, kinds[kind], tp, dtype, inp)
            if cap is not None:
                out.append(cap)
        return _prune_dominated(out, keep)

    # -- solving ----------------------------------------------------------------------------

    def solve(self, inp: PlanningInput, current: Placement | None = None) -> Solution:
        t0 = time.perf_counter()
        current = current or Placement()
        opts = self.options(inp, current.counts().keys())
        lp = _Lp(opts, inp, self._cfg)
        counts, status, bound = lp.solve_counts()
        placement, unplaced = assign_nodes(inp.nodes, opts, counts, current)
        evaluation = self.evaluate(inp, placement, opts)
        return Solution(
            placement=placement,
            counts={o.key: c for o, c in zip(opts, counts, strict=True) if c > 0},
            evaluation=evaluation,
            unplaced=unplaced,
            solve_s=time.perf_counter() - t0,
            status=status,
            goodput_bound_tokens_per_s=bound,
        )

    def evaluate(
        self,
        inp: PlanningInput,
        placement: Placement,
        opts: Sequence[OptionCapacity] | None = None,
    ) -> Evaluation:
        """Goodput of a given placement under the same model (an LP: counts are fixed)."""
        counts = placement.counts()
        opts = opts if opts is not None else self.options(inp, counts.keys())
        by_key = {o.key: o for o in opts}
        fixed = [float(counts.get(o.key, 0)) for o in opts]
        unusable = [k for k in counts if k not in by_key]
        lp = _Lp(opts, inp, self._cfg)
        ev = lp.evaluate(fixed)
        if unusable:  # shapes that cannot run still cost money
            extra = 0.0
            kinds = {n.gpu.name: n.gpu for n in inp.nodes}
            for k in unusable:
                extra += counts[k] * k[3] * kinds[k[2]].price_per_hour if k[2] in kinds else 0.0
            ev = Evaluation(
                ev.goodput_tokens_per_s,
                ev.demand_tokens_per_s,
                ev.served_requests_per_s,
                ev.cost_per_hour + extra,
                ev.gpus_used + sum(counts[k] * k[3] for k in unusable),
            )
        return ev

    def efficiency(self, inp: PlanningInput, current: Placement) -> EfficiencyReport:
        best = self.solve(inp, current)
        now = self.evaluate(inp, current)
        g_best = best.evaluation.goodput_tokens_per_s
        # The MILP stops within its gap; a current placement at least as good is the best one.
        eff = 1.0 if g_best <= 0 else min(1.0, now.goodput_tokens_per_s / g_best)
        return EfficiencyReport(eff, now, best)


def _prune_dominated(opts: list[OptionCapacity], keep: set[OptionKey]) -> list[OptionCapacity]:
    """Drop a shape when another of the same (model, role, kind) uses no more GPUs and delivers
    at least as much per GPU in both phases: it can never be needed, and fewer integer
    variables keep the MILP fast."""
    groups: dict[tuple[str, Role, str], list[OptionCapacity]] = defaultdict(list)
    for o in opts:
        groups[(o.key[0], o.key[1], o.key[2])].append(o)
    out: list[OptionCapacity] = []
    for group in groups.values():
        for o in group:
            dominated = any(
                other is not o
                and other.gpus <= o.gpus
                and other.prefill_tokens_per_s / other.gpus >= o.prefill_tokens_per_s / o.gpus
                and other.decode_tokens_per_s / other.gpus >= o.decode_tokens_per_s / o.gpus
                and (
                    other.gpus < o.gpus
                    or other.prefill_tokens_per_s > o.prefill_tokens_per_s
                    or other.decode_tokens_per_s > o.decode_tokens_per_s
                    or _key_order(other.key) < _key_order(o.key)
                )
                for other in group
            )
            if not dominated or o.key in keep:
                out.append(o)
    return out


def _key_order(k: OptionKey) -> tuple[str, str, str, int, str]:
    return (k[0], k[1].value, k[2], k[3], k[4].value)


_K = 1000.0  # token rates inside the LP are in thousands of tokens/s
_LIMIT_REACHED = 1  # scipy.optimize.milp's status: an iteration or time limit stopped it


class _Lp:
    """The (MI)LP over options; variables [n (O), sp (O), sd (O), g (M)]."""

    def __init__(
        self, opts: Sequence[OptionCapacity], inp: PlanningInput, cfg: PlannerConfig
    ) -> None:
        self.opts = opts
        self.inp = inp
        self.cfg = cfg
        self.models = [m.arch.name for m in inp.models]
        n_o, n_m = len(opts), len(self.models)
        self.n_o, self.n_m = n_o, n_m
        self.nvar = 3 * n_o + n_m
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        ub: list[float] = []
        r = 0

        def add(entries: Iterable[tuple[int, float]], upper: float) -> None:
            nonlocal r
            for c, v in entries:
                rows.append(r)
                cols.append(c)
                vals.append(v)
            ub.append(upper)
            r += 1

        # GPU capacity per kind, nested by TP level (whole groups per node).
        by_kind: dict[str, list[int]] = defaultdict(list)
        for i, o in enumerate(opts):
            by_kind[o.key[2]].append(i)
        for kind, idxs in by_kind.items():
            nodes = [n for n in inp.nodes if n.gpu.name == kind and not n.cordoned]
            for t in sorted({opts[i].tp for i in idxs}):
                cap = sum((n.gpu_count // t) * t for n in nodes)
                add(((i, float(opts[i].gpus)) for i in idxs if opts[i].tp >= t), float(cap))
        # Phase capacity per option.
        for i, o in enumerate(opts):
            sp, sd = n_o + i, 2 * n_o + i
            if o.role is Role.PREFILL:
                add(((sp, 1.0), (i, -o.prefill_tokens_per_s / _K)), 0.0)
            elif o.role is Role.DECODE:
                add(((sd, 1.0), (i, -o.decode_tokens_per_s / _K)), 0.0)
            else:
                add(
                    (
                        (sp, _K / o.prefill_tokens_per_s),
                        (sd, _K / o.decode_tokens_per_s),
                        (i, -cfg.mixed_efficiency),
                    ),
                    0.0,
                )
        # Served requests need both phases' tokens.
        self.weight = np.zeros(n_m)
        self.rate = np.zeros(n_m)
        for j, name in enumerate(self.models):
            d = inp.demand.get(name)
            if d is None or d.arrival_rate_per_s <= 0:
                continue
            mine = [i for i, o in enumerate(opts) if o.model == name]
            g = 3 * n_o + j
            # a served request needs its phases' capacity at the burst-sized rate
            need_p = d.mean_prompt_tokens * d.prefill_peak_factor / _K
            need_d = d.mean_output_tokens * d.decode_peak_factor / _K
            add([(g, need_p)] + [(n_o + i, -1.0) for i in mine], 0.0)
            add([(g, need_d)] + [(2 * n_o + i, -1.0) for i in mine], 0.0)
            self.weight[j] = d.mean_prompt_tokens + d.mean_output_tokens
            self.rate[j] = d.arrival_rate_per_s
        # Minimum workers per model.
        for spec in inp.models:
            if spec.min_workers > 0:
                mine = [i for i, o in enumerate(opts) if o.model == spec.arch.name]
                add(((i, -1.0) for i in mine), -float(spec.min_workers))
        self.a = coo_matrix((vals, (rows, cols)), shape=(r, self.nvar)).tocsr()
        self.ub = np.array(ub)
        lo = np.zeros(self.nvar)
        hi = np.full(self.nvar, np.inf)
        for i, o in enumerate(opts):
            if o.role is Role.DECODE:
                hi[n_o + i] = 0.0
            if o.role is Role.PREFILL:
                hi[2 * n_o + i] = 0.0
        hi[3 * n_o :] = self.rate
        self.lo, self.hi = lo, hi
        self.goodput_c = np.zeros(self.nvar)
        self.goodput_c[3 * n_o :] = self.weight / _K  # k tokens/s: keeps HiGHS well scaled
        self.cost_c = np.zeros(self.nvar)
        for i, o in enumerate(opts):
            self.cost_c[i] = o.cost_per_hour

    def _run(
        self,
        c: np.ndarray,
        integral: bool,
        lo: np.ndarray,
        hi: np.ndarray,
        offset: float = 0.0,
    ) -> tuple[np.ndarray, str]:
        # A constant objective term rides on one extra variable fixed at 1: HiGHS's relative
        # gap is then measured on (unserved demand + cost), not on the whole goodput.
        a = hstack([self.a, csr_matrix((self.a.shape[0], 1))]).tocsr()
        cons = [LinearConstraint(a, -np.inf, self.ub)]
        integrality = np.zeros(self.nvar + 1)
        if integral:
            integrality[: self.n_o] = 1

        options: dict[str, Any] = {"mip_rel_gap": self.cfg.mip_rel_gap}
        if self.cfg.node_limit is not None:
            options["node_limit"] = self.cfg.node_limit

        def solve(limit_s: float) -> Any:
            return milp(
                np.append(c, offset),
                constraints=cons,
                integrality=integrality,
                bounds=Bounds(np.append(lo, 1.0), np.append(hi, 1.0)),
                options={**options, "time_limit": limit_s},
            )

        res = solve(self.cfg.time_limit_s)
        retry_s = max(self.cfg.retry_time_limit_s, self.cfg.time_limit_s)
        if res.x is None and res.status == _LIMIT_REACHED:
            res = solve(retry_s)
        if res.x is None and res.status == _LIMIT_REACHED:
            raise Unavailable(
                f"the solver found no placement within {retry_s:g} s "
                f"({res.message}): the host is too slow or too loaded, not the fleet too small"
            )
        if res.x is None:
            raise FailedPrecondition(
                f"no placement satisfies the constraints ({res.message})", field="min_workers"
            )
        status = "optimal" if res.status == 0 else f"feasible ({res.message})"
        return np.asarray(res.x)[: self.nvar], status

    def solve_counts(self) -> tuple[list[int], str, float]:
        """Goodput first, cost as a tie-break worth ``cost_weight`` of the demand in total."""
        cfg = self.cfg
        demand = float(self.weight @ self.rate) / _K
        fleet_cost = sum(
            n.gpu_count * n.gpu.price_per_hour for n in self.inp.nodes if not n.cordoned
        )
        eps = cfg.cost_weight * max(demand, 1.0) / max(fleet_cost, 1e-9)
        c = -self.goodput_c + eps * self.cost_c
        # The LP relaxation boxes each count (floor - margin .. ceil + margin) and the MILP
        # settles integers inside the box, so its search does not grow with the fleet.
        relaxed, _ = self._run(c, False, self.lo, self.hi, demand)
        lo, hi = self.lo.copy(), self.hi.copy()
        m = float(cfg.integer_margin)
        counts = relaxed[: self.n_o]
        lo[: self.n_o] = np.maximum(np.floor(counts) - m, 0.0)
        hi[: self.n_o] = np.ceil(counts) + m
        x, status = self._run(c, True, lo, hi, demand)
        # Goodput alone, relaxed: an upper bound no placement can beat.
        pure, _ = self._run(-self.goodput_c, False, self.lo, self.hi, demand)
        bound = float(self.goodput_c @ pure) * _K
        return [round(v) for v in x[: self.n_o]], status, bound

    def evaluate(self, counts: Sequence[float]) -> Evaluation:
        lo, hi = self.lo.copy(), self.hi.copy()
        lo[: self.n_o] = counts
        hi[: self.n_o] = counts
        # Fixed counts may exceed the capacity rows (an over-full fleet view): drop those rows'
        # n-terms by evaluating with capacity rows relaxed to what the counts use.
        used = self.a[:, : self.n_o] @ np.asarray(counts, dtype=float)
        saved = self.ub
        self.ub = np.maximum(self.ub, used)
        try:
            x, _ = self._run(-self.goodput_c, False, lo, hi)
        finally:
            self.ub = saved
        served = {name: float(x[3 * self.n_o + j]) for j, name in enumerate(self.models)}
        demand = float(self.weight @ self.rate)
        gpus = int(sum(c * o.gpus for c, o in zip(counts, self.opts, strict=True)))
        return Evaluation(
            goodput_tokens_per_s=float(self.goodput_c @ x) * _K,
            demand_tokens_per_s=demand,
            served_requests_per_s=served,
            cost_per_hour=float(self.cost_c[: self.n_o] @ np.asarray(counts, dtype=float)),
            gpus_used=gpus,
        )


# -- assignment to nodes ----------------------------------------------------------------------


def assign_nodes(
    nodes: Sequence[NodeCapacity],
    opts: Sequence[OptionCapacity],
    counts: Sequence[int],
    current: Placement,
) -> tuple[Placement, tuple[OptionKey, ...]]:
    """Counts per option -> workers on nodes. Keeps existing workers first (same shape, then
    same shape with a new role in place), then best-fit, largest TP groups first."""
    want: Counter[OptionKey] = Counter()
    for o, c in zip(opts, counts, strict=True):
        if c > 0:
            want[o.key] += c
    free = {n.name: (0 if n.cordoned else n.gpu_count) for n in nodes}
    kind_of = {n.name: n.gpu.name for n in nodes}
    placed: list[PlacedWorker] = []
    leftovers: list[PlacedWorker] = []
    for w in current.workers:  # 1. keep what is already right
        if want[w.key] > 0 and w.node in free and free[w.node] >= w.tp:
            want[w.key] -= 1
            free[w.node] -= w.tp
            placed.append(w)
        else:
            leftovers.append(w)
    still: list[PlacedWorker] = []
    for w in leftovers:  # 2. same shape, other role: change the role in place
        new_role = next(
            (
                r
                for r in (Role.PREFILL, Role.DECODE, Role.MIXED)
                if r is not w.role and want[(w.model, r, w.gpu_kind, w.tp, w.dtype)] > 0
            ),
            None,
        )
        if new_role is not None and w.node in free and free[w.node] >= w.tp:
            key = (w.model, new_role, w.gpu_kind, w.tp, w.dtype)
            want[key] -= 1
            free[w.node] -= w.tp
            placed.append(
                PlacedWorker(
                    w.model,
                    new_role,
                    w.gpu_kind,
                    w.tp,
                    w.dtype,
                    w.node,
                    w.worker_id,
                    w.live_sessions,
                    w.kv_used_tokens,
                )
            )
        else:
            still.append(w)
    # 3. best fit for the rest, largest TP first; nodes bucketed by free GPUs per kind
    max_gpus = max((n.gpu_count for n in nodes), default=0)
    buckets: dict[str, list[list[str]]] = defaultdict(lambda: [[] for _ in range(max_gpus + 1)])
    for name, f in free.items():
        buckets[kind_of[name]][f].append(name)
    unplaced: list[OptionKey] = []
    for key in sorted(want, key=lambda k: (-k[3], _key_order(k))):
        model, role, kind, tp, dtype = key
        for _ in range(want[key]):
            b = buckets[kind]
            node = None
            for f in range(tp, max_gpus + 1):
                if b[f]:
                    node = b[f].pop()
                    b[f - tp].append(node)
                    free[node] = f - tp
                    break
            if node is None:
                unplaced.append(key)
                continue
            placed.append(PlacedWorker(model, role, kind, tp, dtype, node))
    return Placement(tuple(placed)), tuple(unplaced)
