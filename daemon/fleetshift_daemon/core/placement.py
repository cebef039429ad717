"""The daemon's placement brain, assembled: routing, the traffic window, and planning.

It joins what the registry knows (nodes, their GPU kinds, workers and their counters) with the
performance model, so the API layer only converts messages. The router's index is rebuilt when
the fleet changes, never per call; heartbeats update load in O(1) per worker.

Online calibration only learns from workers on NVML-discovered nodes: on a declared inventory
(a CPU test fleet) the measured times are the CPU's, and folding them into "H100" would teach
the model something false about H100s.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleetshift_common.bounds import MAX_CONTEXT_TOKENS
from fleetshift_common.engines import REFERENCE
from fleetshift_common.errors import FailedPrecondition, InvalidArgument, NotFound
from fleetshift_daemon.core.burst import BurstSizer
from fleetshift_daemon.core.corrections import CorrectionTable
from fleetshift_daemon.core.engine_fit import TpFit, planned_tp_options, refusal, tp_fit
from fleetshift_daemon.core.estimator import (
    CompletionLedger,
    EstimatorError,
    OutputLengthEstimator,
)
from fleetshift_daemon.core.fleet import InventorySource, NodeRecord, NodeState
from fleetshift_daemon.core.gpus import GpuCatalogue, GpuKind
from fleetshift_daemon.core.model_calibrations import PREDICTED
from fleetshift_daemon.core.perf_factors import CalibrationKey, KindFactors
from fleetshift_daemon.core.perfmodel import Deployment, Dtype, ModelArch, PerfModel
from fleetshift_daemon.core.planner import (
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    PlanningInput,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.planning_cycle import CycleReport, PlanningCycle, demand_from_traffic
from fleetshift_daemon.core.plans import Hysteresis, HysteresisConfig, Plan
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.core.routing import (
    Role,
    RouteDecision,
    Router,
    RouteRequest,
    WorkerView,
)
from fleetshift_daemon.core.slo_monitor import (
    KV_BLOCK_TOKENS,
    LatencySample,
    SloMonitor,
    SloMonitorConfig,
    sample_from_counters,
)
from fleetshift_daemon.core.traffic import TrafficMonitor, TrafficStats
from fleetshift_daemon.core.validation import check_finished, check_route_lengths
from fleetshift_daemon.core.workers import WorkerRecord, WorkerReport, WorkerState, WorkerTable


@dataclass(frozen=True)
class ServedModel:
    arch: ModelArch
    dtypes: tuple[Dtype, ...] = (Dtype.BF16,)
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    min_workers: int = 0
    slo: SloTarget = SloTarget()  # noqa: RUF009 - frozen, so one shared default is safe
    model_dir: str = ""
    # The model's context length (its config's max_position_embeddings): a request longer
    # than this cannot run, so Route refuses it and the traffic window never counts it.
    context_tokens: int = MAX_CONTEXT_TOKENS
    engine: str = REFERENCE  # which tp_options are real (``core.engine_fit``)
    # The engine's arguments, passed to the agent as given (fleetshift_common.config.EngineArgs
    # as JSON; empty for the reference engine).
    engine_args_json: str = ""

    @property
    def snapshots(self) -> bool:
        """Whether its workers can be snapshotted and restored (a warm move): only the
        reference engine's can; a vLLM worker moves cold, its sessions as token history."""
        return self.engine == REFERENCE

    @property
    def name(self) -> str:
        return self.arch.name


@dataclass(frozen=True)
class PredictionBasis:
    """Whether a model's predictions on a GPU kind are measured or from hardware figures."""

    model: str
    gpu_kind: str
    measured: bool
    description: str


@dataclass(frozen=True)
class PlanningSettings:
    threshold: float = 0.95  # efficiency below this is a gap
    hold_s: float = 300.0
    horizon_s: float = 3600.0
    interval_s: float = 30.0  # how often the planning pass runs; 0: the planner is off


@dataclass(frozen=True)
class EfficiencySample:
    taken_at: float
    efficiency: float
    current_goodput: float
    best_goodput: float
    plan_proposed: bool = False


class EfficiencyStore(Protocol):
    def add(self, sample: EfficiencySample) -> None: ...

    def recent(self, limit: int = 100) -> Sequence[EfficiencySample]: ...


@dataclass(frozen=True)
class Routed:
    decision: RouteDecision
    worker: WorkerRecord
    decode_worker: WorkerRecord | None


@dataclass(frozen=True)
class WorkerSlot:
    node: str
    gpu_kind: GpuKind
    gpu_indices: tuple[int, ...]
    reason: str


class PlacementService:
    def __init__(
        self,
        registry: Registry,
        workers: WorkerTable,
        catalogue: GpuCatalogue,
        models: Sequence[ServedModel],
        clock: Callable[[], float],
        efficiency_store: EfficiencyStore,
        settings: PlanningSettings | None = None,
        slo_config: SloMonitorConfig | None = None,
    ) -> None:
        self._registry = registry
        self._workers = workers
        self._catalogue = catalogue
        self.models = {m.name: m for m in models}
        self._clock = clock
        self._efficiency = efficiency_store
        self.settings = settings or PlanningSettings()
        self.traffic = TrafficMonitor(clock)
        self.estimator = OutputLengthEstimator()
        self._completions = CompletionLedger()
        contexts = {m.name: m.context_tokens for m in models}
        self.traffic.set_context_limits(contexts)
        self.estimator.set_context_limits(contexts)
        gate = HysteresisConfig(
            threshold=1.0 - self.settings.threshold,
            hold_s=self.settings.hold_s,
            horizon_s=self.settings.horizon_s,
        )
        self.hysteresis = Hysteresis(clock, gate)
        # issue 11: size for bursts, and let measured latency (heartbeats) close the loop; both
        # outlive a change of performance model (a calibration upload rebuilds the cycle)
        # (the daemon sets its rounds to the heartbeat interval: see ``SloMonitor.observe``)
        self.slo_monitor = SloMonitor(clock, slo_config)
        self._burst = BurstSizer(clock)
        self.last_report: CycleReport | None = None
        self._lock = threading.RLock()
        self._stale = True
        self._describe: Callable[[str, str], str] = lambda model, kind: PREDICTED
        self._use_perf(PerfModel(corrections=CorrectionTable()))

    def _use_perf(self, perf: PerfModel) -> None:
        """Route and plan with ``perf`` from now on (the router's index is rebuilt lazily)."""
        self.perf = perf
        self.router = Router(
            perf,
            [m.arch for m in self.models.values()],
            estimator=self.estimator,
            traffic=self.traffic,
        )
        self._planner = Planner(perf)
        self.cycle = PlanningCycle(
            self._planner,
            perf,
            self.hysteresis,
            clock=self._clock,
            traffic=self.traffic,
            burst=self._burst,
            slo_monitor=self.slo_monitor,
        )
        self._stale = True

    def use_calibrations(
        self,
        calibrations: Mapping[CalibrationKey, KindFactors],
        describe: Callable[[str, str], str],
    ) -> None:
        """Per-(model, GPU kind) factors fitted on uploaded profiles: every prediction for those
        pairs (routing, planning, efficiency) uses them from now on; ``describe`` says what a
        pair's predictions rest on. The online corrections learnt so far are kept."""
        with self._lock:
            self._describe = describe
            self._use_perf(PerfModel(corrections=self.perf.corrections, calibrations=calibrations))

    def prediction_bases(self) -> list[PredictionBasis]:
        """For each served model on each GPU kind of the ready fleet: measured or predicted."""
        kinds = sorted(
            {k.name for n in self._registry.nodes(NodeState.READY) if (k := self.gpu_kind(n))}
        )
        return [
            PredictionBasis(
                model, kind, (model, kind) in self.perf.calibrations, self._describe(model, kind)
            )
            for model in sorted(self.models)
            for kind in kinds
        ]

    # -- the fleet as the performance model sees it ------------------------------------------
    def gpu_kind(self, node: NodeRecord) -> GpuKind | None:
        kinds = Counter(
            k.name for g in node.gpus if (k := self._catalogue.for_product(g.product_name))
        )
        if not kinds:
            return None
        return self._catalogue.get(kinds.most_common(1)[0][0])

    def forget_worker(self, worker_id: str) -> None:
        """A worker's record left the registry: its last counters and latency samples go too
        (``WorkerTable.on_forget``)."""
        self.traffic.forget_worker(worker_id)
        self.slo_monitor.forget_worker(worker_id)

    def fleet_changed(self) -> None:
        """A worker or node changed: the index is rebuilt before the next call that reads it.

        Lazy, so registering a thousand nodes costs one rebuild, not a thousand."""
        self._stale = True

    def _fresh(self) -> None:
        if self._stale:
            with self._lock:
                if self._stale:
                    self._stale = False
                    self.refresh_fleet()

    def refresh_fleet(self) -> None:
        """Rebuild the router's index from the registry now."""
        views = []
        nodes = {n.name: n for n in self._registry.nodes()}
        kinds: dict[str, GpuKind | None] = {}  # once per node, not per worker
        for w in self._workers.alive():
            node = nodes.get(w.node)
            if node is not None and w.node not in kinds:
                kinds[w.node] = self.gpu_kind(node)
            kind = kinds.get(w.node)
            if node is None or kind is None or w.spec.model not in self.models or not w.endpoint:
                continue  # (a worker still starting has no endpoint: nothing could reach it)
            counters = w.counters
            views.append(
                WorkerView(
                    id=w.id,
                    node=w.node,
                    model=w.spec.model,
                    role=w.spec.role,
                    gpu=kind,
                    tp=w.spec.tp,
                    dtype=w.spec.dtype,
                    queue_tokens=counters.queue_depth if counters else 0,
                    kv_used_tokens=(counters.kv_blocks_used * KV_BLOCK_TOKENS) if counters else 0,
                    kv_total_tokens=(
                        counters.kv_blocks_total * KV_BLOCK_TOKENS
                        if counters and counters.kv_blocks_total
                        else None
                    ),
                    live_sessions=counters.live_sessions if counters else 0,
                    healthy=node.state is NodeState.READY and _takes_sessions(w),
                    cordoned=node.cordoned,
                )
            )
        self.router.update_fleet(views)

    def observe_heartbeat(self, node: NodeRecord) -> None:
        """Load and traffic from one heartbeat's worker counters.

        The router's index is not rebuilt here when stale: the rebuild (at the next Route)
        reads every worker's counters from the worker table, which the heartbeat has already
        updated. Rebuilding here made registering N nodes cost N rebuilds of O(fleet) each
        (each new node's first heartbeat adopts its workers and stales the index)."""
        stale = self._stale
        learn = node.inventory_source is InventorySource.NVML
        self.slo_monitor.observe(self._latency_samples(node))
        for counters in node.workers:
            worker = self._workers.find(counters.worker_id)
            if worker is None or worker.spec.model not in self.models:
                continue
            # The mix counts the worker's tokens whether or not the router indexes it yet.
            self.traffic.observe_counters(
                counters.worker_id,
                worker.spec.model,
                counters.prefill_tokens,
                counters.decode_tokens,
                born_at=self._workers.born_at(worker),
            )
            try:
                if not stale:
                    self.router.update_load(
                        counters.worker_id,
                        queue_tokens=counters.queue_depth,
                        kv_used_tokens=counters.kv_blocks_used * KV_BLOCK_TOKENS,
                        live_sessions=counters.live_sessions,
                        healthy=node.state is NodeState.READY and _takes_sessions(worker),
                        cordoned=node.cordoned,
                    )
            except NotFound:
                continue  # not in the index yet: the next refresh brings it in
            if learn and counters.tbt_p50_ms > 0 and counters.live_sessions > 0:
                kind = self.gpu_kind(node)
                if kind is not None:
                    dep = Deployment(
                        self.models[worker.spec.model].arch, kind, worker.spec.tp, worker.spec.dtype
                    )
                    self.perf.record_decode_step(
                        dep,
                        counters.live_sessions,
                        counters.kv_blocks_used * KV_BLOCK_TOKENS,
                        counters.tbt_p50_ms / 1000.0,
                    )

    def _latency_samples(self, node: NodeRecord) -> list[LatencySample]:
        """The heartbeat's measured latencies, for the SLO monitor (served models only)."""
        out = []
        for c in node.workers:
            worker = self._workers.find(c.worker_id)
            if worker is None or worker.spec.model not in self.models:
                continue
            out.append(sample_from_counters(c, worker.spec.model, worker.spec.role))
        return out

    # -- Route -------------------------------------------------------------------------------
    def route(self, request: RouteRequest) -> Routed:
        served = self.models.get(request.model)
        if served is not None:
            check_route_lengths(request, served.context_tokens)
        self._fresh()
        decision = self.router.route(request)  # also feeds the traffic window
        worker = self._workers.get(decision.worker_id)
        decode = (
            self._workers.get(decision.decode_worker_id)
            if decision.decode_worker_id and decision.decode_worker_id != decision.worker_id
            else None
        )
        return Routed(decision, worker, decode)

    def observe_completion(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        self.estimator.observe_completion(model, prompt_tokens, output_tokens)

    def check_finished(self, reports: Sequence[WorkerReport]) -> None:
        """Refuse (naming ``workers[i].finished_sessions[j]...``) a heartbeat that reports a
        finished session its model's context cannot hold; call before the heartbeat changes
        anything. Workers of a model not served here are not checked: they teach nothing."""
        for i, report in enumerate(reports):
            served = self.models.get(report.spec.model)
            if served is not None and report.finished:
                check_finished(
                    report.finished, served.context_tokens, f"workers[{i}].finished_sessions"
                )

    def observe_finished(self, reports: Sequence[WorkerReport]) -> int:
        """Feed the estimator each finished session a heartbeat reports, once per (worker,
        session id) however many heartbeats repeat it; returns how many were new."""
        n = 0
        for report in reports:
            if report.spec.model not in self.models or not report.finished:
                continue
            for c in self._completions.fresh(report.worker_id, report.finished):
                self.estimator.observe_completion(
                    report.spec.model, c.prompt_tokens, c.output_tokens
                )
                n += 1
        return n

    # -- PlaceWorker -------------------------------------------------------------------------
    def place_worker(
        self,
        model: str,
        role: Role,
        tp: int,
        dtype: Dtype,
        prefer_kind: str = "",
        *,
        exclude_nodes: Iterable[str] = (),
        reserved: Iterable[tuple[str, int]] = (),
    ) -> WorkerSlot:
        """The best node and GPUs for a new worker; ``reserved`` GPUs (node, index) are taken
        by moves planned in the same operation, ``exclude_nodes`` are never chosen."""
        served = self._served(model)
        if tp < 0 or (tp and tp not in served.tp_options):
            raise InvalidArgument(
                f"tensor_parallel {tp} is not among the model's options {served.tp_options}",
                field="tensor_parallel",
            )
        if prefer_kind and prefer_kind not in self._catalogue:
            raise NotFound(
                f"GPU kind {prefer_kind!r} is not in the catalogue", field="prefer_gpu_kind"
            )
        best: tuple[tuple[float, float, int], WorkerSlot] | None = None
        excluded, taken = set(exclude_nodes), set(reserved)
        engine_refused: NodeRecord | None = None
        for node in self._registry.nodes(NodeState.READY):
            kind = self.gpu_kind(node)
            if node.cordoned or kind is None or node.name in excluded:
                continue
            busy = self._workers.gpus_in_use(node.name) | {i for n, i in taken if n == node.name}
            free = sorted({g.index for g in node.gpus} - busy)
            for size in (tp,) if tp else sorted(served.tp_options):
                if len(free) < size or not self._fits(served, kind, size, dtype):
                    continue
                if tp_fit(served.engine, size, node) is TpFit.REFUSED:
                    engine_refused = node
                    continue
                rate = self._phase_rate(served, kind, size, dtype, role)
                if rate <= 0:
                    continue  # cannot meet the SLO in this shape
                # Goodput first (as the planner), then the preference, the lower $/h, and
                # best fit (fuller nodes first) to break ties.
                rank = (
                    rate * (1.5 if kind.name == prefer_kind else 1.0),
                    -kind.price_per_hour * size,
                    -len(free),
                )
                slot = WorkerSlot(
                    node.name,
                    kind,
                    tuple(free[:size]),
                    f"{kind.name} x{size}: {rate:,.0f} {role.value} tokens/s within SLO",
                )
                if best is None or rank > best[0]:
                    best = (rank, slot)
                break
        if best is None and engine_refused is not None and tp:
            raise refusal(model, served.engine, tp, engine_refused.name)
        if best is None:
            raise FailedPrecondition(
                f"no ready, uncordoned node has free GPUs that fit {model!r} "
                f"(tp {tp or 'any'}, {dtype.value})",
                field="model",
            )
        return best[1]

    def tp_fit(self, model: str, node_name: str, tp: int) -> TpFit | None:
        """Whether ``model``'s engine runs ``tp`` on that node; None for an unknown one."""
        served = self.models.get(model)
        node = next((n for n in self._registry.nodes() if n.name == node_name), None)
        if served is None or node is None:
            return None
        return tp_fit(served.engine, tp, node)

    def _served(self, model: str) -> ServedModel:
        served = self.models.get(model)
        if served is None:
            raise NotFound(f"model {model!r} is not served by this fleet", field="model")
        return served

    def _fits(self, served: ServedModel, kind: GpuKind, tp: int, dtype: Dtype) -> bool:
        try:
            return self.perf.kv_capacity_tokens(Deployment(served.arch, kind, tp, dtype)) > 0
        except FailedPrecondition:
            return False

    def _phase_rate(
        self, served: ServedModel, kind: GpuKind, tp: int, dtype: Dtype, role: Role
    ) -> float:
        """Tokens/s within the SLO for the phase(s) the role serves, at the current mix (the
        planner's own capacity model, so PlaceWorker and plans agree)."""
        spec = ModelSpec(served.arch, (dtype,), (tp,), 0)
        cap = self._planner.option_capacity(spec, role, kind, tp, dtype, self.planning_input())
        if cap is None:
            return 0.0
        if role is Role.PREFILL:
            rate = cap.prefill_tokens_per_s
        elif role is Role.DECODE:
            rate = cap.decode_tokens_per_s
        else:
            rate = (cap.prefill_tokens_per_s * cap.decode_tokens_per_s) ** 0.5
        return float(rate)

    # -- planning ----------------------------------------------------------------------------
    def current_placement(self) -> Placement:
        # Workers on a lost node serve nothing the router can reach and their GPUs are outside
        # the planning input: planning them as capacity would fail the pass (their GPU kind
        # may be on no live node) and hide the shortfall a replacement should fill.
        nodes = {n.name: n for n in self._registry.nodes(NodeState.READY)}
        placed = []
        for w in self._workers.alive():
            node = nodes.get(w.node)
            kind = self.gpu_kind(node) if node else None
            if kind is None or w.spec.model not in self.models:
                continue
            counters = w.counters
            placed.append(
                PlacedWorker(
                    model=w.spec.model,
                    role=w.spec.role,
                    gpu_kind=kind.name,
                    tp=w.spec.tp,
                    dtype=w.spec.dtype,
                    node=w.node,
                    worker_id=w.id,
                    live_sessions=counters.live_sessions if counters else 0,
                    kv_used_tokens=(counters.kv_blocks_used * KV_BLOCK_TOKENS) if counters else 0,
                )
            )
        return Placement(tuple(placed))

    def planning_input(self) -> PlanningInput:
        nodes = []
        ready = self._registry.nodes(NodeState.READY)
        for node in ready:
            kind = self.gpu_kind(node)
            if kind is not None:
                nodes.append(NodeCapacity(node.name, kind, len(node.gpus), node.cordoned))
        specs = [
            ModelSpec(
                m.arch, m.dtypes, planned_tp_options(m.engine, m.tp_options, ready), m.min_workers
            )
            for m in self.models.values()
        ]
        demand = demand_from_traffic(self.traffic, self.models)
        slos = {m.name: m.slo for m in self.models.values()}
        return planning_input(nodes, specs, demand, slos)

    def run_cycle(self) -> CycleReport:
        """The periodic job: efficiency, its history, and whether to propose the plan."""
        with self._lock:
            report = self.cycle.run(self.planning_input(), self.current_placement())
            self.last_report = report
        self._efficiency.add(
            EfficiencySample(
                taken_at=self._clock(),
                efficiency=report.efficiency,
                current_goodput=report.current_goodput_tokens_per_s,
                best_goodput=report.best.evaluation.goodput_tokens_per_s,
                plan_proposed=report.decision.propose,
            )
        )
        return report

    def preview(self) -> CycleReport:
        """What the next periodic pass would report now (``run_cycle`` without committing):
        the same burst-sized demand, plan, gate verdict and measured loop, with no sample
        recorded and no clock, memory or loan of the planner changed."""
        with self._lock:
            return self.cycle.dry_run(self.planning_input(), self.current_placement())

    def dry_run(self) -> Plan:
        """The plan of ``preview``: what an operator's rebalance runs, the plan they saw."""
        return self.preview().plan

    def efficiency_history(self, limit: int) -> Sequence[EfficiencySample]:
        return self._efficiency.recent(limit)

    def below_threshold_for_s(self) -> float:
        report = self.last_report
        if report is None or report.decision.gap_since is None:
            return 0.0
        return max(0.0, self._clock() - report.decision.gap_since)

    # -- traffic -----------------------------------------------------------------------------
    def traffic_stats(self, model: str = "") -> list[tuple[TrafficStats, EstimatorError]]:
        names: Iterable[str] = [model] if model else sorted(self.models)
        if model:
            self._served(model)
        out = []
        for name in names:
            try:
                stats = self.traffic.stats(name)
            except NotFound:
                continue
            out.append((stats, self.estimator.error(name)))
        return out


def _takes_sessions(worker: WorkerRecord) -> bool:
    """A draining worker (being moved or retired), or one not serving yet, is routed to only
    when nothing else can."""
    return worker.state is WorkerState.SERVING
