"""The central daemon's composition root: config in, a running gRPC server out.

Everything with a lifetime (database engine, registry view, gRPC server, periodic jobs, the
systemd watchdog) is created and stopped here, in one order, so no module holds a global.
Readiness is announced (health SERVING, sd_notify READY, port file) only after the schema is
upgraded and the registry is loaded: a client that sees the daemon ready sees every node.

Replicas (docs/replicas.md): on PostgreSQL several daemons share the database and the one
holding the lease (``replicas.py``) runs the executor, the planner and the liveness sweep; the
others serve reads and heartbeats from a view they refresh, and pass calls that change the
fleet to the leader (``api/leader_gate.py``). On SQLite the one daemon leads from its start,
exactly as before; a second one is refused.

Every background job (liveness sweep, planning pass, watchdog) runs as a named task that
``stop`` cancels and awaits before the database is disposed; blocking work inside them runs
through ``in_thread``, which lets a thread end its write even when its task is cancelled, so
nothing writes to a disposed engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import IO, Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from fleetshift_common.blocking import in_thread
from fleetshift_common.config import DaemonConfig
from fleetshift_common.failpoints import Failpoints
from fleetshift_common.lifecycle import write_port_file
from fleetshift_common.sdnotify import SdNotifier, watchdog_interval
from fleetshift_daemon import models
from fleetshift_daemon.api import calibration as calibration_api
from fleetshift_daemon.api import fleet as fleet_api
from fleetshift_daemon.api import operations as operations_api
from fleetshift_daemon.api import placement as placement_api
from fleetshift_daemon.api.leader_gate import LeaderGate
from fleetshift_daemon.api.operations import OperationsServicer
from fleetshift_daemon.clients.fleet import GrpcFleetClient
from fleetshift_daemon.core.execution import ExecutionSettings, Executor
from fleetshift_daemon.core.fleet import NodeState
from fleetshift_daemon.core.gpus import GpuCatalogue, default_catalogue
from fleetshift_daemon.core.hearing import TICK_S as HEARING_TICK_S
from fleetshift_daemon.core.hearing import HearingClock
from fleetshift_daemon.core.leadership import Leadership, LeaseSettings
from fleetshift_daemon.core.model_calibrations import Calibrations
from fleetshift_daemon.core.moves import MoveLimits, MovePlanner
from fleetshift_daemon.core.operations import OperationLog
from fleetshift_daemon.core.placement import PlacementService, PlanningSettings, ServedModel
from fleetshift_daemon.core.planning_cycle import CycleReport
from fleetshift_daemon.core.registry import Registry, SilenceGuard
from fleetshift_daemon.core.slo_monitor import SloMonitorConfig
from fleetshift_daemon.core.submission import Submission
from fleetshift_daemon.core.workers import WorkerTable
from fleetshift_daemon.move_signals import MoveSignals
from fleetshift_daemon.replicas import ReplicaLoop, replica_identity, sole_owner_lock
from fleetshift_daemon.store.calibration_store import SqlCalibrationStore
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_daemon.store.traffic_store import SqlArrivalStore
from fleetshift_daemon.store.view_mark import VIEWS, stale_views, view_mark
from fleetshift_daemon.store.work_store import (
    SqlEfficiencyStore,
    SqlOperationStore,
    SqlWorkerStore,
)
from fleetshift_daemon.traffic_share import TrafficShare
from fleetshift_rpc.auth import ServerSecurity, server_security
from fleetshift_rpc.metrics import DaemonMetrics, MetricsEndpoint, start_metrics_server
from fleetshift_rpc.ratelimit import RateLimit
from fleetshift_rpc.server import RunningServer, ServiceBinding, start_server

log = logging.getLogger("fleetshift.daemon")

FLEET_METRICS_EVERY_S = 1.0
HISTORY_PRUNE_EVERY_S = 60.0  # finished operations and efficiency samples: a DELETE a minute


@dataclass
class Daemon:
    config: DaemonConfig
    clock: Callable[[], float] = time.time
    notifier: SdNotifier = field(default_factory=SdNotifier.from_env)
    engine: Engine | None = None
    registry: Registry | None = None
    workers: WorkerTable | None = None
    server: RunningServer | None = None
    operator_server: RunningServer | None = None
    metrics: DaemonMetrics = field(default_factory=DaemonMetrics)
    metrics_endpoint: MetricsEndpoint | None = None
    security: ServerSecurity | None = None
    catalogue: GpuCatalogue = field(default_factory=default_catalogue)
    models: list[ServedModel] = field(default_factory=list)
    placement: PlacementService | None = None
    calibrations: Calibrations | None = None
    operations: OperationLog | None = None
    efficiency_history: SqlEfficiencyStore | None = None
    moves: MovePlanner | None = None
    executor: Executor | None = None
    submission: Submission | None = None
    failpoints: Failpoints = field(default_factory=Failpoints)
    leadership: Leadership | None = None
    replica_loop: ReplicaLoop | None = None
    traffic_share: TrafficShare | None = None  # replicas: the leader plans on every arrival
    gate: LeaderGate | None = None
    _sole_lock: IO[str] | None = None
    _lease_engine: Engine | None = None  # PostgreSQL: the lease thread's own connection
    _scheduler: AsyncIOScheduler | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)  # named background jobs
    _fleet_metrics_at: float = -math.inf  # when the fleet gauges were last published
    _history_pruned_at: float = -math.inf  # by ``clock``, as the retention is
    _mass_silence: bool = False  # the silence guard spared nodes at the last sweep
    hearing: HearingClock = field(init=False)  # liveness time: stalls of the loop left out
    _view_mark: tuple[str, ...] | None = None  # a follower's last read of the database...
    _view_read_at: float = -math.inf  # ...and when (monotonic)

    def __post_init__(self) -> None:
        self.hearing = HearingClock(self.clock)

    @property
    def port(self) -> int:
        assert self.server is not None, "daemon not started"
        return self.server.port

    async def start(self) -> None:
        cfg = self.config
        self.security = self._security()  # config errors surface before any database work
        self.catalogue = models.catalogue(cfg)
        self.models = models.served_models(cfg)
        self.engine = make_engine(cfg.effective_database_url)
        await asyncio.to_thread(upgrade, self.engine)
        await self._claim_leadership()
        assert self.leadership is not None
        # Every write the leader decides (executor, sweep, cordons) carries it
        # (store/lease_store.py); registrations are the agents' own and are not fenced.
        fence = self.leadership.token
        self.registry = Registry(
            SqlRegistryStore(self.engine, fence),
            self.clock,
            cfg.node_lost_after_s,
            silence_guard=SilenceGuard(cfg.mass_silence_fraction, cfg.mass_silence_min_nodes),
            hearing=self.hearing,
        )
        await asyncio.to_thread(self.registry.load)
        self.workers = WorkerTable(SqlWorkerStore(self.engine, fence), self.clock)
        await asyncio.to_thread(self.workers.load)
        self.efficiency_history = SqlEfficiencyStore(self.engine, fence)
        self.placement = PlacementService(
            self.registry,
            self.workers,
            self.catalogue,
            self.models,
            self.clock,
            self.efficiency_history,
            PlanningSettings(
                cfg.planner.threshold,
                cfg.planner.hold_s,
                cfg.planner.horizon_s,
                interval_s=cfg.planner.interval_s,
            ),
            SloMonitorConfig(round_s=cfg.heartbeat_interval_s),
        )
        self.workers.on_change(self.placement.fleet_changed)
        self.workers.on_forget(self.placement.forget_worker)
        if self.replica_loop is not None:  # before serving: every Route call is published
            self.placement.traffic.keep_own_arrivals()
        self.calibrations = await asyncio.to_thread(self._load_calibrations)
        # Liveness reaches the router through each heartbeat's health flags; a rebuild of the
        # index per lost/back node would turn a heartbeat storm into a Route storm.
        self.registry.on_change(self.placement.fleet_changed, liveness=False)
        self.operations = OperationLog(SqlOperationStore(self.engine, fence), self.clock)
        self.operations.on_change(MoveSignals(self.metrics))  # phase and pause histograms
        await asyncio.to_thread(self.operations.load)
        p = cfg.planner
        self.moves = MovePlanner(
            self.registry,
            self.workers,
            self.placement,
            MoveLimits(p.max_moves_in_flight, p.max_moves_per_node, p.max_moves_per_model),
            retire_surplus=p.retire_surplus,
        )
        tls = self.security.tls
        self.executor = Executor(
            self.operations,
            self.registry,
            self.workers,
            self.placement,
            GrpcFleetClient(cfg.max_message_bytes, tls.channel_credentials() if tls else None),
            self.metrics,
            self.clock,
            self.failpoints,
            ExecutionSettings(drain_timeout_s=p.drain_timeout_s),
        )
        self.submission = Submission(
            self.operations, self.moves, self.executor, self.placement, self.registry
        )
        await self._serve()
        if self.replica_loop is None:
            self.executor.recover()  # the sole daemon: what it left when it last stopped
        else:
            self._start_replica()
        self._start_jobs()
        assert self.server is not None
        write_port_file(cfg.port_file, self.server.port)
        self.notifier.ready(f"serving on port {self.server.port}")
        log.info(
            "daemon ready",
            extra={"port": self.server.port, "nodes": len(self.registry.nodes())},
        )

    async def _claim_leadership(self) -> None:
        """SQLite: this daemon is the only one (a file lock proves it) and leads at once.
        PostgreSQL: it starts as a follower; the lease loop decides who leads."""
        assert self.engine is not None
        rc = self.config.replicas
        settings = LeaseSettings(rc.lease_ttl_s, rc.renew_interval_s, rc.renew_deadline_s)
        address = rc.advertise_address or self.config.listen
        self.leadership = Leadership(replica_identity(), address, settings, time.monotonic)
        store = SqlLeaseStore(self.engine)
        if self.engine.dialect.name == "sqlite":
            self._sole_lock = sole_owner_lock(self.engine)
            view = await asyncio.to_thread(store.take, self.leadership.identity, address)
            self.leadership.lead_for_good(view)
            return
        # The lease renews on its own connection: a pool drained by Route's reads must not
        # make a renewal wait past the deadline (see replicas.ReplicaLoop.run_lease).
        self._lease_engine = make_engine(self.config.effective_database_url, pool=1)
        self.replica_loop = ReplicaLoop(
            self.leadership,
            SqlLeaseStore(self._lease_engine),
            self._refresh_view,
            self._elected,
            self._deposed,
            rc.view_refresh_s,
        )

    def _start_replica(self) -> None:
        """The bound port is known now: advertise it unless the operator named an address."""
        assert self.leadership is not None and self.replica_loop is not None
        assert self.server is not None
        if not self.config.replicas.advertise_address:
            host = self.config.listen.rpartition(":")[0]
            self.leadership.address = f"{host}:{self.server.port}"
        self._spawn("lease", self.replica_loop.run_lease())
        self._spawn("view refresh", self.replica_loop.run_refresh())
        assert self.placement is not None and self.engine is not None
        self.traffic_share = TrafficShare(
            self.placement.traffic,
            SqlArrivalStore(self.engine, self.leadership.token),
            self.leadership.identity,
            self.leadership.acting,
            self.clock,
        )
        self._spawn("route arrivals", self.traffic_share.run())

    def _refresh_view(self) -> None:
        """Blocking: what the leader wrote since the last look (nodes, workers, operations).

        Only the views whose tables' part of the database's mark (``store/view_mark.py``)
        differs from the one taken before the last read are re-read, and all of them once the
        last full read is ``replicas.view_full_read_s`` old. The mark is taken before reading:
        a write landing during the read changes the next mark, so it is read then."""
        assert self.registry is not None and self.workers is not None
        assert self.operations is not None and self.engine is not None
        mark = view_mark(self.engine)
        now = time.monotonic()
        full = now - self._view_read_at >= self.config.replicas.view_full_read_s
        stale = VIEWS if full else stale_views(self._view_mark, mark)
        if "registry" in stale:
            self.registry.refresh()
        if "workers" in stale:
            self.workers.refresh()
        if "operations" in stale:
            self.operations.refresh()
        self._view_mark = mark
        if stale == VIEWS:
            self._view_read_at = now

    async def _elected(self) -> None:
        """A new tenure: recover every running operation as a restarted daemon would, but
        run a rolled-back step again where it still holds (docs/replicas.md)."""
        assert self.executor is not None and self.leadership is not None
        self.executor.recover(
            f"the leader changed (daemon {self.leadership.address} took over)", replan=True
        )

    async def _deposed(self) -> None:
        assert self.executor is not None
        await self.executor.abandon()

    def _acting(self) -> bool:
        return self.leadership is None or self.leadership.acting()

    def _load_calibrations(self) -> Calibrations:
        """Stored per-(model, GPU kind) calibrations, applied to every prediction now and
        after each upload."""
        placement = self.placement
        assert self.engine is not None and placement is not None
        archs = {m.name: m.arch for m in self.models}
        cals = Calibrations(SqlCalibrationStore(self.engine), self.catalogue, archs, self.clock)
        cals.load()
        cals.on_change(lambda factors: placement.use_calibrations(factors, cals.describe))
        return cals

    def _security(self) -> ServerSecurity:
        cfg = self.config
        return server_security(
            listen=cfg.listen,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            tls_ca=cfg.tls_ca,
            operator_listen=cfg.operator_listen,
            operator_tokens_file=cfg.operator_tokens_file,
            read_only_open=cfg.read_only_open,
            rate_limit=RateLimit(
                cfg.rate_limit_per_s, cfg.rate_limit_burst, cfg.rate_limit_max_clients
            ),
            on_refused=self.metrics.refused,
        )

    async def _serve(self) -> None:
        """Start the gRPC port(s) and the metrics endpoint; readiness is flipped by start()."""
        cfg, sec = self.config, self.security
        assert sec is not None and self.leadership is not None
        bindings = self._bindings()
        # Forwarding would present this daemon's certificate as the operator's: under TLS a
        # follower names the leader instead (api/leader_gate.py).
        self.gate = LeaderGate(self.leadership, sec.tls is None, cfg.max_message_bytes)
        interceptors = (*sec.interceptors, self.gate)
        self.server = await start_server(
            cfg.listen, bindings, cfg.max_message_bytes, sec.credentials, interceptors
        )
        if cfg.operator_listen:
            self.operator_server = await start_server(
                cfg.operator_listen,
                bindings,
                cfg.max_message_bytes,
                sec.operator_credentials,
                interceptors,
            )
        if cfg.metrics_listen:
            host, _, port = cfg.metrics_listen.rpartition(":")
            self.metrics_endpoint = start_metrics_server(self.metrics.registry, int(port), host)
        for server in (self.server, self.operator_server):
            if server is not None:
                await server.set_serving(True)

    def _bindings(self) -> list[ServiceBinding]:
        assert self.registry is not None
        interval_ms = int(self.config.heartbeat_interval_s * 1000)
        assert self.workers is not None and self.placement is not None
        assert self.operations is not None and self.moves is not None and self.executor
        assert self.submission is not None
        assert self.calibrations is not None
        ops = OperationsServicer(
            self.operations,
            self.moves,
            self.executor,
            self.placement,
            self.workers,
            self.submission,
        )
        return [
            *operations_api.bindings(ops),
            *fleet_api.bindings(
                self.registry,
                interval_ms,
                self.metrics,
                self.workers,
                self.placement,
                acting=self._acting,
            ),
            *placement_api.bindings(
                self.placement,
                self.workers,
                self.metrics,
                self.replica_loop.catch_up if self.replica_loop else placement_api.no_catch_up,
            ),
            *calibration_api.bindings(self.calibrations, self.placement),
        ]

    def _start_jobs(self) -> None:
        scheduler = AsyncIOScheduler()
        scheduler.add_job(
            self._job,
            "interval",
            args=("liveness sweep", self._sweep),
            seconds=self.config.liveness_check_interval_s,
            id="liveness-sweep",
            max_instances=1,
            coalesce=True,
        )
        if self.config.planner.interval_s > 0:
            scheduler.add_job(
                self._job,
                "interval",
                args=("planning pass", self._plan),
                seconds=self.config.planner.interval_s,
                id="planner",
                max_instances=1,
                coalesce=True,
            )
        scheduler.start()
        self._scheduler = scheduler
        self._spawn("hearing ticker", self._tick_hearing())
        interval = watchdog_interval()
        if interval:
            self._spawn("systemd watchdog", self._ping_watchdog(interval))

    async def _tick_hearing(self) -> None:
        """Times the event loop's stalls for the liveness clock (core/hearing.py)."""
        while True:
            self.hearing.tick()
            await asyncio.sleep(HEARING_TICK_S)

    def _spawn(self, name: str, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(job, name=f"fleetshiftd {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _job(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """One run of a periodic job, as a named task that stop() can cancel and await."""
        if not self._acting():
            return  # a follower: the leader runs the sweep and the planner
        task = asyncio.current_task()
        assert task is not None
        task.set_name(f"fleetshiftd {name}")
        self._tasks.add(task)
        try:
            await run()
        except asyncio.CancelledError:
            log.debug("%s cancelled: the daemon is stopping", name)  # the scheduler's last word
        finally:
            self._tasks.discard(task)

    async def _sweep(self) -> None:
        assert self.registry is not None
        try:
            turned = await in_thread(self.registry.sweep)
        except Exception:
            log.exception("liveness sweep failed; retrying at the next interval")
            return
        for name in turned:
            log.warning("node lost: no heartbeat within the timeout", extra={"node": name})
        self._report_mass_silence(self.registry.silent_unjudged)
        await self._prune_ended_workers()
        if not 0.0 <= self.clock() - self._history_pruned_at < HISTORY_PRUNE_EVERY_S:
            await self._prune_history()
        if turned:
            self.metrics.node_lost(len(turned))
        # The fleet gauges walk every GPU of the fleet on the event loop: at most once a
        # second (and at once when nodes turned lost), however short the sweep interval.
        now = time.monotonic()
        if turned or now - self._fleet_metrics_at >= FLEET_METRICS_EVERY_S:
            self._fleet_metrics_at = now
            self._publish_fleet_metrics()

    def _report_mass_silence(self, silent: int) -> None:
        """Say once when the silence guard starts sparing nodes and once when it stops (every
        sweep would flood the log); the gauge shows how many it spares meanwhile."""
        self.metrics.nodes_silent_unjudged.set(silent)
        if silent and not self._mass_silence:
            log.warning(
                "%d ready node(s) silent past node_lost_after_s at once, more than "
                "mass_silence_fraction of the fleet: suspecting this daemon or its network, "
                "not the nodes; declaring none of them lost until the share falls back",
                silent,
            )
        elif self._mass_silence and not silent:
            log.warning("the mass silence ended: silent nodes turn lost again as they time out")
        self._mass_silence = silent > 0

    async def _prune_ended_workers(self) -> None:
        assert self.workers is not None
        try:
            pruned = await in_thread(self.workers.prune_ended, self.config.ended_worker_retention_s)
        except Exception:
            log.exception("pruning ended workers failed; retrying at the next sweep")
            return
        if pruned:
            log.info(
                "deleted %d ended worker record(s) older than %.0f s: %s",
                len(pruned),
                self.config.ended_worker_retention_s,
                ", ".join(pruned),
            )

    async def _prune_history(self) -> None:
        """Finished operations and efficiency samples past ``history_retention_s``: the two
        records every planning pass can add to, kept for audit, not forever."""
        assert self.operations is not None and self.efficiency_history is not None
        self._history_pruned_at = now = self.clock()
        retention_s = self.config.history_retention_s
        try:
            ops = await in_thread(self.operations.prune_finished, retention_s)
            samples = await in_thread(self.efficiency_history.prune_before, now - retention_s)
        except Exception:
            log.exception("pruning the history failed; retrying in %.0f s", HISTORY_PRUNE_EVERY_S)
            return
        if ops or samples:
            log.info(
                "deleted %d finished operation(s) and %d efficiency sample(s) older than %.0f s",
                len(ops),
                samples,
                retention_s,
            )

    def _publish_fleet_metrics(self) -> None:
        assert self.registry is not None
        gpus: Counter[tuple[str, str]] = Counter()
        nodes: Counter[str] = Counter()
        for node in self.registry.nodes():
            state = (
                "cordoned" if node.cordoned and node.state is NodeState.READY else node.state.value
            )
            nodes[state] += 1
            for gpu in node.gpus:
                kind = self.catalogue.for_product(gpu.product_name)
                gpus[(kind.name if kind else gpu.product_name, state)] += 1
        self.metrics.set_fleet(gpus, nodes)

    async def _plan(self) -> None:
        """The periodic planning pass: publish efficiency; propose (or run) a plan."""
        assert self.placement is not None
        try:
            report = await in_thread(self._planning_cycle)
        except Exception:
            log.exception("planning pass failed; retrying at the next interval")
            return
        self.metrics.set_efficiency(report.efficiency, report.plan.gain_tokens_per_s)
        self.metrics.set_slo_attainment(  # issue 11: measured latency beside the model
            {m: a.attainment for m, a in report.measured.items() if a.attainment is not None},
            self.placement.slo_monitor.config.target,
            report.predicted_attainment,
        )
        for stats, _ in self.placement.traffic_stats():
            self.metrics.set_traffic(
                stats.model, stats.arrival_rate_per_s, stats.prompt.mean, stats.output.mean
            )
        if not report.decision.propose and report.decision.gap_since is not None:
            # Below target and nothing proposed: say why (the hold, or a plan whose moves
            # cost more than they gain), or a figure that stays low reads as a stuck planner.
            log.info(
                "placement below target: plan held",
                extra={
                    "efficiency": round(report.efficiency, 4),
                    "moves": ", ".join(m.kind.value for m in report.plan.moves),
                    "reason": report.decision.reason,
                },
            )
        if report.decision.propose:
            log.warning(
                "placement below target: plan proposed",
                extra={
                    "efficiency": round(report.efficiency, 4),
                    "moves": len(report.plan.moves),
                    "reason": report.decision.reason,
                },
            )
            if self.config.planner.automatic:
                assert self.submission is not None
                await self.submission.run_plan(report.plan)

    def _planning_cycle(self) -> CycleReport:
        assert self.placement is not None
        self.failpoints.hit("during:planning")  # tests stop the daemon in a planning pass
        return self.placement.run_cycle()

    async def _ping_watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking requests, then every background job, then the executor's operations,
        and only then dispose of the database: nothing is left that could write to it."""
        self.notifier.stopping()
        for server in (self.server, self.operator_server):
            if server is not None:
                await server.set_serving(False)
                await server.server.stop(grace_s)
        if self._scheduler:
            self._scheduler.shutdown(wait=False)  # no new runs; the running ones are below
        jobs = list(self._tasks)
        for task in jobs:
            task.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        if self.executor:
            await self.executor.stop()
        if self.gate:
            await self.gate.close()
        if self.metrics_endpoint:
            self.metrics_endpoint.stop()
        if self.registry and self._acting():
            await asyncio.to_thread(self.registry.sweep)  # flush heartbeat times
        if self.traffic_share:  # the calls of its last interval, for the other replicas
            try:
                await asyncio.to_thread(self.traffic_share.flush)
            except SQLAlchemyError as err:
                log.warning("publishing the last route arrivals failed: %s", err)
        if self.replica_loop:
            await self.replica_loop.release()  # a follower takes over now, not after the TTL
        if self._lease_engine:
            self._lease_engine.dispose()
        if self.engine:
            self.engine.dispose()
        if self._sole_lock:
            self._sole_lock.close()
