"""Choose the worker (or prefill + decode pair) for one request by a soft score.

The score multiplies phase fit (how fast this worker's GPU kind runs the phase the request is
heavy in, relative to the model's best), predicted latency against the SLO (from the
performance model, with the worker's queue and live batch), load and KV headroom (a long
context avoids a worker where it would evict others). Nothing is a hard filter: a cordoned or
unhealthy worker only scores very low, so a request is still answered when the preferred pool
is full; it goes elsewhere rather than queue.

Load is this request's own prefill time on the worker against that time plus the wait for the
prompts queued ahead of it, so phase fit x load is the best unloaded prefill time over this
worker's predicted TTFT: the worker that would answer first wins, the heterogeneous form of
join-the-shortest-queue (shortest expected delay). It used to be the wait against the TTFT
SLO, which is near 1 until the queue approaches the SLO: a faster GPU's phase fit then kept
every request on the faster kind until its queue neared the SLO, and under 10x bursts the
tail of TTFT was twice least-loaded's on the same fleet (issue 11). A worker that decodes is
further scored down by its predicted step time against the TBT SLO (a bigger batch slows every
session on it; without this a decode pool fills its fastest worker first).

Speed: the daemon answers thousands of Route calls per second against a thousand nodes, so no
call walks every worker. Workers of a model are grouped into classes (role, GPU kind, TP,
dtype) whose performance coefficients are computed once; a call scores each class, samples a
few workers per class (power of d choices picks the least loaded) and scores only those. A
routed request is counted on its workers at once (queue, sessions, KV) until the next heartbeat
replaces the counters, so calls between two heartbeats do not all pick the same worker.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fleetshift_common.errors import InvalidArgument, NotFound
from fleetshift_common.vocabulary import Role as Role  # re-exported: routing names roles
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.errors import UnsupportedDeployment
from fleetshift_daemon.core.estimator import OutputLengthEstimator
from fleetshift_daemon.core.gpus import GpuKind
from fleetshift_daemon.core.perfmodel import (
    Deployment,
    Dtype,
    ModelArch,
    PerfCoefficients,
    PerfModel,
)
from fleetshift_daemon.core.traffic import TrafficMonitor


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tbt_ms: float | None = None


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker (from the registry and the last heartbeat)."""

    id: str
    node: str
    model: str
    role: Role
    gpu: GpuKind
    tp: int
    dtype: Dtype = Dtype.BF16
    queue_tokens: int = 0  # prompt tokens waiting for prefill
    kv_used_tokens: int = 0
    kv_total_tokens: int | None = None  # None: the performance model's capacity
    live_sessions: int = 0
    healthy: bool = True
    cordoned: bool = False


@dataclass(frozen=True)
class RouteRequest:
    model: str
    prompt_tokens: int
    expected_output_tokens: int | None = None
    slo: Slo | None = None
    preferred_worker_id: str | None = None
    reroute: bool = False  # already counted in the traffic mix when first routed


@dataclass(frozen=True)
class ScoreTerms:
    phase_fit: float
    latency: float
    load: float
    kv_headroom: float
    health: float
    affinity: float
    total: float
    predicted_ttft_ms: float
    predicted_tbt_ms: float


@dataclass(frozen=True)
class RouteDecision:
    worker_id: str  # the worker the request goes to first (the prefill worker of a pair)
    prefill_worker_id: str | None  # set for a split pair
    decode_worker_id: str | None
    reason: str
    terms: ScoreTerms
    output_tokens: float
    output_estimated: bool
    candidates_scored: int


@dataclass(frozen=True)
class SkippedWorker:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class RouterConfig:
    # Power of d choices inside each worker class, sampled without replacement. 2 left a
    # 12-worker class with a p99 TTFT 1.5x least-loaded's under 10x on-off bursts; 8 matched or
    # beat it (chosen on the tuning data, Azure minutes 0-30 with on-off arrivals: see
    # docs/bench-sim.md, "Routing under bursts").
    per_class_samples: int = 8
    default_ttft_ms: float = 2000.0  # latency scale when the request states no SLO
    default_tbt_ms: float = 100.0
    slo_miss_penalty: float = 4.0  # score falls as 1 / (1 + penalty * relative overshoot)
    affinity_bonus: float = 1.5  # preferred worker (prefix cache, session) when it has room
    kv_link_gbps: float = 50.0  # inter-node bandwidth a split pair moves the KV over
    cordoned_factor: float = 0.01
    unhealthy_factor: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.per_class_samples < 1:
            raise InvalidArgument("per_class_samples must be >= 1", field="per_class_samples")
        for name in ("default_ttft_ms", "default_tbt_ms", "kv_link_gbps", "affinity_bonus"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0", field=name)


_SLOT = {Role.MIXED: 0, Role.PREFILL: 1, Role.DECODE: 2}


class _Worker:
    __slots__ = (
        "cls",
        "cordoned",
        "health",
        "healthy",
        "id",
        "kv_total",
        "kv_used",
        "queue",
        "sessions",
    )

    def __init__(self, view: WorkerView, cls: _Class, cfg: RouterConfig) -> None:
        self.id = view.id
        self.cls = cls
        self.queue = view.queue_tokens
        self.kv_used = view.kv_used_tokens
        self.kv_total = view.kv_total_tokens or cls.coeff.kv_capacity_tokens
        self.sessions = view.live_sessions
        self.set_health(view.healthy, view.cordoned, cfg)

    def set_health(self, healthy: bool, cordoned: bool, cfg: RouterConfig) -> None:
        """The health factor of the score, computed here (a heartbeat) and not per call."""
        self.healthy, self.cordoned = healthy, cordoned
        self.health = (
            1.0
            if healthy and not cordoned
            else cfg.cordoned_factor
            if healthy
            else cfg.unhealthy_factor
        )


@dataclass(eq=False)
class _Class:
    role: Role
    gpu: GpuKind
    tp: int
    dtype: Dtype
    dep: Deployment
    coeff: PerfCoefficients
    workers: list[_Worker] = field(default_factory=list)
    small: bool = False  # random.sample's list branch (set at the end of update_fleet)
    shape: int = 0  # index of (dep, coeff) in its _ModelIndex.shapes

    @property
    def label(self) -> str:
        return f"{self.gpu.name} x{self.tp} {self.dtype.value} {self.role.value}"


@dataclass(eq=False)
class _ModelIndex:
    arch: ModelArch
    classes: list[_Class] = field(default_factory=list)
    shapes: list[tuple[Deployment, PerfCoefficients]] = field(default_factory=list)


class _Cand:
    """One scored worker; plain slots, turned into ScoreTerms only for the winner."""

    __slots__ = (
        "affinity",
        "health",
        "kv",
        "latency",
        "load",
        "phase_fit",
        "tbt",
        "total",
        "ttft",
        "worker",
    )

    def __init__(
        self,
        total: float,
        worker: _Worker,
        ttft: float,
        tbt: float,
        phase_fit: float,
        latency: float,
        load: float,
        kv: float,
        health: float,
        affinity: float,
    ) -> None:
        self.total, self.worker, self.ttft, self.tbt = total, worker, ttft, tbt
        self.phase_fit, self.latency, self.load, self.kv = phase_fit, latency, load, kv
        self.health, self.affinity = health, affinity

    def terms(self) -> ScoreTerms:
        return ScoreTerms(
            self.phase_fit,
            self.latency,
            self.load,
            self.kv,
            self.health,
            self.affinity,
            self.total,
            self.ttft * 1e3,
            self.tbt * 1e3,
        )


class Router:
    """Holds an indexed copy of the fleet; ``route`` reads it, ``update_*`` refresh it."""

    def __init__(
        self,
        perf: PerfModel,
        models: Iterable[ModelArch],
        *,
        estimator: OutputLengthEstimator | None = None,
        traffic: TrafficMonitor | None = None,
        config: RouterConfig | None = None,
    ) -> None:
        self._perf = perf
        self._archs = {m.name: m for m in models}
        self._estimator = estimator
        self._traffic = traffic
        self._cfg = config or RouterConfig()
        self._rng = random.Random(self._cfg.seed)
        self._index: dict[str, _ModelIndex] = {}
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.Lock()

    # -- fleet view -------------------------------------------------------------------------

    def set_models(self, models: Iterable[ModelArch]) -> None:
        """Architectures the router can model; takes effect at the next ``update_fleet``."""
        self._archs = {m.name: m for m in models}

    def update_fleet(self, workers: Sequence[WorkerView]) -> tuple[SkippedWorker, ...]:
        """Replace the whole view (registry change). O(workers); not on the per-call path.

        A worker the router cannot model (unknown model architecture, a shape the performance
        model rejects) is left out and reported, so one odd worker never blocks routing.
        """
        index: dict[str, _ModelIndex] = {}
        by_id: dict[str, _Worker] = {}
        classes: dict[tuple[str, Role, str, int, Dtype], _Class | None] = {}
        skipped: list[SkippedWorker] = []
        for i, w in enumerate(workers):
            if w.id in by_id:
                raise InvalidArgument(f"worker {w.id!r} listed twice", field=f"workers[{i}].id")
            arch = self._archs.get(w.model)
            if arch is None:
                skipped.append(SkippedWorker(w.id, f"model {w.model!r} has no known architecture"))
                continue
            key = (w.model, w.role, w.gpu.name, w.tp, w.dtype)
            if key not in classes:
                classes[key] = self._new_class(arch, w)
                cls = classes[key]
                if cls is not None:
                    index.setdefault(w.model, _ModelIndex(arch)).classes.append(cls)
            cls = classes[key]
            if cls is None:
                skipped.append(
                    SkippedWorker(
                        w.id,
                        f"{w.gpu.name} x{w.tp} {w.dtype.value} "
                        f"cannot run {w.model!r} in the performance model",
                    )
                )
                continue
            worker = _Worker(w, cls, self._cfg)
            cls.workers.append(worker)
            by_id[w.id] = worker
        k = self._cfg.per_class_samples
        for m in index.values():
            seen: dict[Deployment, int] = {}
            for c in m.classes:
                c.small = len(c.workers) <= _sample_setsize(k)
                if c.dep not in seen:
                    seen[c.dep] = len(m.shapes)
                    m.shapes.append((c.dep, c.coeff))
                c.shape = seen[c.dep]
        with self._lock:
            self._index = index
            self._workers = by_id
        return tuple(skipped)

    def _new_class(self, arch: ModelArch, w: WorkerView) -> _Class | None:
        dep = Deployment(arch=arch, gpu=w.gpu, tp=w.tp, dtype=w.dtype)
        # A worker that runs with less memory headroom than the model's default reserve is
        # still real: fall back to no reserve before giving up on it.
        for reserve in (0.1, 0.0):
            try:
                return _Class(
                    w.role, w.gpu, w.tp, w.dtype, dep, self._perf.coefficients(dep, reserve)
                )
            except UnsupportedDeployment:
                continue
        return None

    def update_load(
        self,
        worker_id: str,
        *,
        queue_tokens: int,
        kv_used_tokens: int,
        live_sessions: int,
        healthy: bool = True,
        cordoned: bool = False,
    ) -> None:
        """A heartbeat's counters; O(1)."""
        w = self._workers.get(worker_id)
        if w is None:
            raise NotFound(f"worker {worker_id!r} is not known", field="worker_id")
        w.queue, w.kv_used, w.sessions = queue_tokens, kv_used_tokens, live_sessions
        w.set_health(healthy, cordoned, self._cfg)

    # -- routing ----------------------------------------------------------------------------

    def route(self, req: RouteRequest) -> RouteDecision:
        cfg = self._cfg
        idx, out, estimated, ttft_slo, tbt_slo, preferred = self._validate(req)
        prompt = req.prompt_tokens
        sq = float(prompt) * prompt
        need_kv = prompt + out
        ctx_add = prompt + out / 2.0
        corr = self._perf.correction

        # Unloaded phase times per deployment shape (the classes of one shape differ only in
        # role): the reference for phase and hardware fit.
        shapes = []
        for dep, co in idx.shapes:
            cp = corr(dep, Phase.PREFILL)
            cd = corr(dep, Phase.DECODE)
            shapes.append((cp, cd, co.prefill_s(prompt, sq, 1) * cp, co.decode_s(1, ctx_add) * cd))
        best_p = min(r[2] for r in shapes)
        best_d = min(r[3] for r in shapes)
        share_p = best_p / (best_p + out * best_d)  # of the request's time, on the best GPUs

        pen = cfg.slo_miss_penalty
        best: list[_Cand | None] = [None, None, None]  # indexed by _SLOT[role]
        scored = 0
        aff_bonus = cfg.affinity_bonus
        for c in idx.classes:
            cp, cd, ref_p, ref_d = shapes[c.shape]
            role = c.role
            co = c.coeff
            rel_p, rel_d = best_p / ref_p, best_d / ref_d
            if role is Role.PREFILL:
                phase_fit = rel_p
            elif role is Role.DECODE:
                phase_fit = rel_d
            else:
                phase_fit = share_p * rel_p + (1.0 - share_p) * rel_d
            does_p = role is not Role.DECODE
            does_d = role is not Role.PREFILL
            # co.prefill_s / co.decode_s unrolled: the worker-independent part once per class
            p_base = co.p0 + co.p_tok * prompt + co.p_sq * sq + co.p_seq
            p_tok, knee, p_knee = co.p_tok, co.knee_tokens, co.p_knee
            # the request's predicted TTFT on an empty queue, in the same unrolled form
            p_alone = (p_base + (p_knee * (prompt - knee) if prompt > knee else 0.0)) * cp
            d_base = co.d0 + co.d_seq + co.d_ctx * ctx_add
            d_seq, d_ctx = co.d_seq, co.d_ctx
            slot = _SLOT[role]
            current = best[slot]
            # The best of this slot so far, as plain locals: a _Cand is made once per class,
            # not at every improvement (the arithmetic below is the score's, in its order:
            # a factor that is exactly 1.0 is left out, which changes no bit of a product).
            b_total = current.total if current is not None else -1.0
            b_w: _Worker | None = None
            b_ttft = b_tbt = b_lat = b_load = b_kv = b_aff = 0.0
            # Dominance: with every coefficient >= 0 the score falls (weakly, and so does each
            # rounded step of it) as queue, sessions or KV in use grow. A worker of full
            # health, not preferred, loaded at least as much as this class's leader (also of
            # full health and affinity) on every counter its role reads, and of the same KV
            # capacity, cannot beat it: it is not scored. Same choice, fewer scored.
            dominance = (
                pen >= 0.0
                and cp > 0.0
                and cd > 0.0
                and p_tok >= 0.0
                and p_knee >= 0.0
                and d_seq >= 0.0
                and d_ctx >= 0.0
            )
            b_plain = False
            b_q = b_s = b_u = b_cap = 0
            sample = self._sample(c, preferred)
            scored += len(sample)
            for w in sample:
                if (
                    b_plain
                    and w.health == 1.0
                    and w is not preferred
                    and (not does_p or w.queue >= b_q)
                    and (
                        not does_d
                        or (w.sessions >= b_s and w.kv_used >= b_u and w.kv_total == b_cap)
                    )
                ):
                    continue
                ttft = tbt = 0.0
                load = 1.0
                latency = 1.0
                if does_p:
                    q = w.queue
                    ttft = p_base + p_tok * q
                    if q + prompt > knee:
                        ttft += p_knee * (q + prompt - knee)
                    ttft *= cp
                    # own time / (own time + the queue's wait): phase fit x load is the
                    # best unloaded prefill time over this worker's predicted TTFT
                    load = ref_p / (ref_p + max(ttft - p_alone, 0.0))
                    over_t = ttft / ttft_slo - 1.0
                    if over_t > 0:
                        latency = 1.0 + pen * over_t
                kv = 1.0
                if does_d:
                    tbt = (d_base + d_seq * w.sessions + d_ctx * w.kv_used) * cd
                    over_d = tbt / tbt_slo - 1.0
                    if over_d > 0:
                        latency = latency * (1.0 + pen * over_d)
                    # a bigger batch slows every session on it, SLO or not
                    load /= 1.0 + tbt / tbt_slo
                    # >= 20 % free after: 1; full: 0.3; would evict others: 0.05
                    total_kv = w.kv_total
                    free_after = total_kv - w.kv_used - need_kv
                    kv = (
                        0.05
                        if free_after < 0
                        else 0.3 + 0.7 * min(1.0, free_after / (0.2 * total_kv))
                    )
                latency = 1.0 / latency
                total = phase_fit * latency * load * kv
                health = w.health
                if health != 1.0:
                    total *= health
                affinity = 1.0
                if w is preferred:
                    affinity = aff_bonus
                    total *= affinity
                if total > b_total or (b_w is None and current is None):
                    b_total, b_w, b_ttft, b_tbt = total, w, ttft, tbt
                    b_lat, b_load, b_kv, b_aff = latency, load, kv, affinity
                    b_plain = dominance and health == 1.0 and affinity == 1.0
                    b_q, b_s, b_u, b_cap = w.queue, w.sessions, w.kv_used, w.kv_total
            if b_w is not None:
                best[slot] = _Cand(
                    b_total, b_w, b_ttft, b_tbt, phase_fit, b_lat, b_load, b_kv, b_w.health, b_aff
                )
        decision = self._decide(req, best, out, estimated, scored, ttft_slo)
        self._count_routed(decision, prompt, need_kv)
        return decision

    def _count_routed(self, d: RouteDecision, prompt: int, need_kv: float) -> None:
        """Count the request on its workers now; the next heartbeat replaces the counters.

        Without this, every call between two heartbeats sees the same loads and sends its
        request to the same least-loaded worker (a burst lands on one worker).
        """
        first = self._workers.get(d.worker_id)
        if first is None:
            return
        first.queue += prompt
        dec = self._workers.get(d.decode_worker_id) if d.decode_worker_id else first
        if dec is not None and dec.cls.role is not Role.PREFILL:
            dec.sessions += 1
            dec.kv_used += int(need_kv)

    def _validate(
        self, req: RouteRequest
    ) -> tuple[_ModelIndex, float, bool, float, float, _Worker | None]:
        cfg = self._cfg
        if isinstance(req.prompt_tokens, bool) or req.prompt_tokens <= 0:
            raise InvalidArgument(
                f"prompt_tokens must be > 0, got {req.prompt_tokens}", field="prompt_tokens"
            )
        idx = self._index.get(req.model)
        if idx is None:
            raise NotFound(f"model {req.model!r} is served by no worker", field="model")
        slo = req.slo or Slo()
        for name, value in (("ttft_ms", slo.ttft_ms), ("tbt_ms", slo.tbt_ms)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"slo.{name} must be > 0, got {value}", field=f"slo.{name}")
        # A hint (prefix cache, session affinity), never a filter: a worker that is unknown,
        # stopped or serving another model is simply not preferred.
        preferred = self._workers.get(req.preferred_worker_id or "")
        if preferred is not None and preferred.cls.dep.arch.name != req.model:
            preferred = None
        if req.expected_output_tokens is not None:
            if req.expected_output_tokens <= 0:
                raise InvalidArgument(
                    "expected_output_tokens must be > 0 when given",
                    field="expected_output_tokens",
                )
            out, estimated = float(req.expected_output_tokens), False
        elif self._estimator is not None:
            out, estimated = self._estimator.estimate(req.model, req.prompt_tokens), True
        else:
            out, estimated = 256.0, True
        if self._traffic is not None and not req.reroute:
            self._traffic.observe_request(req.model, req.prompt_tokens, out)
        ttft = (slo.ttft_ms or cfg.default_ttft_ms) / 1e3
        tbt = (slo.tbt_ms or cfg.default_tbt_ms) / 1e3
        return idx, out, estimated, ttft, tbt, preferred

    def _sample(self, c: _Class, preferred: _Worker | None) -> list[_Worker]:
        workers = c.workers
        k = self._cfg.per_class_samples
        n = len(workers)
        draw = self._rng.getrandbits
        pool = list(workers) if n <= k else _draw(draw, workers, n, k, c.small)
        if preferred is not None and preferred.cls is c and preferred not in pool:
            pool.append(preferred)
        return pool

    def _decide(
        self,
        req: RouteRequest,
        best: list[_Cand | None],
        out: float,
        estimated: bool,
        scored: int,
        ttft_slo: float,
    ) -> RouteDecision:
        single, p, d = best
        # A split pair needs a prefill side and a decode side; a mixed worker can stand in for
        # either (the planner places prefill-only workers feeding mixed ones, and mixed ones
        # feeding decode-only ones), never for both.
        pre, dec = p or single, d or single
        pair = (
            self._pair_terms(req, pre, dec, ttft_slo)
            if pre is not None and dec is not None and pre is not dec
            else None
        )
        if single is None and pair is None:
            # Only one side of a split pool exists: it still answers, scored down.
            only = p or d
            assert only is not None
            terms = _scaled(only.terms(), 0.1)
            return self._decision(
                only.worker,
                None,
                None,
                terms,
                out,
                estimated,
                scored,
                "no complete pool for this model; ",
            )
        if pair is not None and (single is None or pair.total > single.total):
            assert pre is not None and dec is not None
            return self._decision(
                pre.worker, pre.worker, dec.worker, pair, out, estimated, scored, ""
            )
        assert single is not None
        return self._decision(single.worker, None, None, single.terms(), out, estimated, scored, "")

    def _pair_terms(self, req: RouteRequest, p: _Cand, d: _Cand, ttft_slo: float) -> ScoreTerms:
        cfg = self._cfg
        kv_bytes = req.prompt_tokens * d.worker.cls.coeff.kv_bytes_per_token
        ttft = p.ttft + kv_bytes / (cfg.kv_link_gbps * 1e9)
        over_t = max(0.0, ttft / ttft_slo - 1.0)
        lat = d.latency / (1.0 + cfg.slo_miss_penalty * over_t)
        phase_fit = math.sqrt(p.phase_fit * d.phase_fit)
        health, affinity = min(p.health, d.health), max(p.affinity, d.affinity)
        total = phase_fit * lat * p.load * d.kv * health * affinity
        return ScoreTerms(
            phase_fit, lat, p.load, d.kv, health, affinity, total, ttft * 1e3, d.tbt * 1e3
        )

    def _decision(
        self,
        first: _Worker,
        prefill: _Worker | None,
        decode: _Worker | None,
        t: ScoreTerms,
        out: float,
        estimated: bool,
        scored: int,
        prefix: str,
    ) -> RouteDecision:
        if prefill is not None and decode is not None:
            where = (
                f"prefill on {prefill.id} ({prefill.cls.label}), decode on {decode.id} "
                f"({decode.cls.label})"
            )
        else:
            where = f"{first.id} ({first.cls.label})"
        est = "estimated " if estimated else ""
        reason = (
            f"{prefix}{where}: predicted TTFT {t.predicted_ttft_ms:.0f} ms, TBT "
            f"{t.predicted_tbt_ms:.1f} ms for {est}{out:.0f} output tokens; score {t.total:.3g} "
            f"= phase fit {t.phase_fit:.2f} x latency {t.latency:.2f} x load {t.load:.2f} x KV "
            f"headroom {t.kv_headroom:.2f} x health {t.health:.2g} x affinity {t.affinity:.2g}; "
            f"best of {scored} candidates"
        )
        return RouteDecision(
            worker_id=first.id,
            prefill_worker_id=prefill.id if prefill else None,
            decode_worker_id=decode.id if decode else None,
            reason=reason,
            terms=t,
            output_tokens=out,
            output_estimated=estimated,
            candidates_scored=scored,
        )


def _sample_setsize(k: int) -> int:
    """Where ``random.Random.sample`` switches from its list branch to its set branch."""
    setsize = 21
    if k > 5:
        setsize += 4 ** math.ceil(math.log(k * 3, 4))
    return setsize


def _draw(
    getrandbits: Callable[[int], int], population: list[_Worker], n: int, k: int, small: bool
) -> list[_Worker]:
    """``random.Random.sample(population, k)``, the same draws from the same generator (so
    the same workers, call after call), without its per-draw method calls: this ran 6-9
    times per Route call and cost more than the scoring of the workers it picked. Checked
    against ``Random.sample`` in tests/core/test_routing_choices.py."""
    result: list[_Worker] = []
    if small:
        pool = list(population)
        for i in range(k):
            m = n - i
            bits = m.bit_length()
            j = getrandbits(bits)
            while j >= m:
                j = getrandbits(bits)
            result.append(pool[j])
            pool[j] = pool[m - 1]
        return result
    bits = n.bit_length()
    selected: set[int] = set()
    for _ in range(k):
        j = getrandbits(bits)
        while j >= n or j in selected:
            j = getrandbits(bits)
        selected.add(j)
        result.append(population[j])
    return result


def _scaled(t: ScoreTerms, factor: float) -> ScoreTerms:
    return ScoreTerms(
        t.phase_fit * factor,
        t.latency,
        t.load,
        t.kv_headroom,
        t.health,
        t.affinity,
        t.total * factor,
        t.predicted_ttft_ms,
        t.predicted_tbt_ms,
    )
