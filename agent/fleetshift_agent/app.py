"""The node agent's composition root: discover GPUs, serve AgentService, stay registered.

The agent is ready (sd_notify READY, port file) as soon as its own server listens: a daemon
that is down must not keep a node's agent from starting, it only delays registration. Workers
left running by a previous agent process are adopted before the agent registers, so its first
heartbeat already reports them and the daemon never sees them vanish across an agent restart.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from fleetshift.v1 import agent_pb2, snapshot_pb2, snapshot_pb2_grpc
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_agent import service
from fleetshift_agent.discovery import DECLARED, Inventory, discover, package_version
from fleetshift_agent.engines import EngineSupport
from fleetshift_agent.membership import Backoff, Membership
from fleetshift_agent.restore_compat import NodePlatform
from fleetshift_agent.snapshot import RetentionPolicy, SnapshotStore
from fleetshift_agent.snapshot.service import SnapshotServicer
from fleetshift_agent.supervisor import Supervisor, SupervisorSettings, join_host_port
from fleetshift_common.config import AgentConfig
from fleetshift_common.lifecycle import write_port_file
from fleetshift_common.sdnotify import SdNotifier, watchdog_interval
from fleetshift_rpc.auth import ServerSecurity, server_security
from fleetshift_rpc.metrics import AgentMetrics, MetricsEndpoint, start_metrics_server
from fleetshift_rpc.ratelimit import RateLimit
from fleetshift_rpc.security import PrincipalKind, check_plaintext_allowed, parse_callers
from fleetshift_rpc.server import RunningServer, ServiceBinding, start_server

log = logging.getLogger("fleetshift.agent")


@dataclass
class Agent:
    config: AgentConfig
    inventory: Inventory | None = None
    notifier: SdNotifier = field(default_factory=SdNotifier.from_env)
    server: RunningServer | None = None
    membership: Membership | None = None
    security: ServerSecurity | None = None
    metrics: AgentMetrics = field(init=False)
    metrics_endpoint: MetricsEndpoint | None = None
    supervisor: Supervisor | None = None
    store: SnapshotStore | None = None
    engines: EngineSupport = field(init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engines = EngineSupport(self.config.vllm_python)
        self.metrics = AgentMetrics(
            node=self.config.node_name, version=package_version("fleetshift")
        )

    @property
    def port(self) -> int:
        assert self.server is not None, "agent not started"
        return self.server.port

    @property
    def advertise_address(self) -> str:
        if self.config.advertise_address:
            return self.config.advertise_address
        host = self.config.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        self.security = server_security(
            listen=cfg.listen,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            tls_ca=cfg.tls_ca,
            read_only_open=cfg.read_only_open,
            rate_limit=RateLimit(
                cfg.rate_limit_per_s, cfg.rate_limit_burst, cfg.rate_limit_max_clients
            ),
            expect=(PrincipalKind.NODE, cfg.node_name),
            on_refused=self.metrics.refused,
        )
        if self.inventory is None:
            self.inventory = await asyncio.to_thread(discover, cfg)
        await self._start_workers()
        await asyncio.to_thread(self.engines.vllm_missing)  # probed once, off the loop
        assert self.supervisor is not None and self.store is not None
        tls = self.security.tls
        servicer = service.AgentServicer(
            self._info,
            self.supervisor,
            self.store,
            peer_credentials=tls.channel_credentials() if tls else None,
            max_message_bytes=cfg.max_message_bytes,
            retention=_retention(cfg),
            metrics=self.metrics,
            engines=self.engines,
        )
        self.server = await start_server(
            cfg.listen,
            [
                service.binding(servicer),
                _snapshot_binding(
                    SnapshotServicer(
                        self.store,
                        platform=NodePlatform.of(cfg.node_name, self.inventory),
                        peer_credentials=tls.channel_credentials() if tls else None,
                        max_message_bytes=cfg.max_message_bytes,
                        on_sent=lambda size: self.metrics.transferred("sent", size),
                    )
                ),
            ],
            cfg.max_message_bytes,
            self.security.credentials,
            self.security.interceptors,
        )
        if cfg.metrics_listen:
            host, _, port = cfg.metrics_listen.rpartition(":")
            self.metrics_endpoint = start_metrics_server(self.metrics.registry, int(port), host)
        self.membership = Membership(
            cfg.daemon_address,
            self._registration,
            self._heartbeat,
            Backoff(cfg.reconnect_initial_s, cfg.reconnect_max_s),
            cfg.max_message_bytes,
            tls.channel_credentials() if tls else None,
            heartbeat_sent=self._heartbeat_sent,
            report_lock=self.supervisor.reporting,
            on_heartbeat=self.metrics.heartbeat,
        )
        self._tasks.append(asyncio.create_task(self.membership.run()))
        self._tasks.append(asyncio.create_task(self._poll_workers()))
        interval = watchdog_interval()
        if interval:
            self._tasks.append(asyncio.create_task(self._ping_watchdog(interval)))
        await self.server.set_serving(True)
        write_port_file(cfg.port_file, self.server.port)
        self.notifier.ready(f"serving on port {self.server.port}")
        log.info(
            "agent ready",
            extra={
                "node": cfg.node_name,
                "port": self.server.port,
                "inventory": self.inventory.source,
            },
        )

    async def _start_workers(self) -> None:
        """The snapshot store and the supervisor, with the workers a previous agent left."""
        assert self.inventory is not None
        cfg = self.config
        state = Path(cfg.state_dir)
        self.store = await asyncio.to_thread(SnapshotStore, state / "snapshots")
        declared = self.inventory.source == DECLARED
        self.supervisor = Supervisor(
            SupervisorSettings(
                state_dir=state / "workers",
                gpus=frozenset(g.index for g in self.inventory.gpus),
                declared_products=(
                    {g.index: g.product_name for g in self.inventory.gpus} if declared else {}
                ),
                cuda=not declared,
                compile=cfg.worker_compile,
                compile_artifacts=cfg.worker_compile_artifacts,
                threads=cfg.worker_threads,
                start_timeout_s=cfg.worker_start_timeout_s,
                host=self._worker_host(),
                node_name=cfg.node_name,
                tls=self.security.tls if self.security else None,
                session_callers=cfg.worker_session_callers,
                vllm_python=cfg.vllm_python,
            )
        )
        supervisor = self.supervisor
        supervisor.on_change(lambda: self.metrics.set_workers(supervisor.counts()))
        await self.supervisor.adopt()
        await self.supervisor.poll()  # the first heartbeat carries their counters too

    def _worker_host(self) -> str:
        """Where workers listen (docs/multihost.md): the node's address, checked before any
        worker exists so that a bad key stops the agent at start with the key named. With
        TLS the workers present this node's certificate; plaintext stays on loopback."""
        cfg = self.config
        host = cfg.effective_worker_host
        parse_callers(cfg.worker_session_callers)
        tls = self.security.tls if self.security else None
        if tls is None:
            check_plaintext_allowed(join_host_port(host, 0), "worker_host")
        else:
            tls.check_host(host, "worker_host")
        return host

    async def _poll_workers(self) -> None:
        assert self.supervisor is not None and self.membership is not None
        while True:
            await asyncio.sleep(self.membership.interval_s)
            try:
                await self.supervisor.poll()
            except Exception:  # a bug must not end worker reporting: log and go on
                log.exception("polling workers failed")

    async def _ping_watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _gpus(self) -> list[pb.Gpu]:
        assert self.inventory is not None
        return [
            pb.Gpu(
                index=g.index,
                product_name=g.product_name,
                memory_bytes=g.memory_bytes,
                bandwidth_class=g.bandwidth_class,
                compute_capability=g.compute_capability,
                fp8_supported=g.fp8_supported,
                nvlink_peers=list(g.nvlink_peers),
                uuid=g.uuid,
            )
            for g in self.inventory.gpus
        ]

    def _versions(self) -> pb.NodeVersions:
        assert self.inventory is not None
        return pb.NodeVersions(
            driver=self.inventory.driver_version,
            cuda=self.inventory.cuda_version,
            torch=package_version("torch"),
            agent=package_version("fleetshift"),
        )

    def _source(self) -> int:
        assert self.inventory is not None
        declared = self.inventory.source == DECLARED
        return pb.INVENTORY_SOURCE_DECLARED if declared else pb.INVENTORY_SOURCE_NVML

    def _registration(self) -> pb.RegisterNodeRequest:
        return pb.RegisterNodeRequest(
            node_name=self.config.node_name,
            agent_address=self.advertise_address,
            gpus=self._gpus(),
            versions=self._versions(),
            inventory_source=self._source(),  # type: ignore[arg-type]
        )

    def _heartbeat(self) -> pb.HeartbeatRequest:
        workers = self.supervisor.statuses() if self.supervisor else []
        return pb.HeartbeatRequest(node_name=self.config.node_name, workers=workers)

    def _heartbeat_sent(self, request: pb.HeartbeatRequest) -> None:
        if self.supervisor is not None:
            self.supervisor.reported(request.workers)

    def _info(self) -> agent_pb2.AgentInfo:
        return agent_pb2.AgentInfo(
            node_name=self.config.node_name,
            gpus=self._gpus(),
            versions=self._versions(),
            inventory_source=self._source(),  # type: ignore[arg-type]
            daemon_address=self.config.daemon_address,
            registered=bool(self.membership and self.membership.registered.is_set()),
            workers=self.supervisor.statuses() if self.supervisor else [],
            engines=self.engines.names(),
            engine_notes=self.engines.notes(),
        )

    async def stop(self, grace_s: float = 1.0) -> None:
        self.notifier.stopping()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.server:
            await self.server.server.stop(grace_s)
        if self.metrics_endpoint:
            self.metrics_endpoint.stop()


def _retention(cfg: AgentConfig) -> RetentionPolicy | None:
    policy = RetentionPolicy(
        keep_last_per_model=cfg.snapshot_keep_last_per_model or None,
        max_age_s=cfg.snapshot_max_age_s or None,
        max_total_bytes=int(cfg.snapshot_max_total_gb * 1024**3) or None,
    )
    return policy if policy != RetentionPolicy() else None


def _snapshot_binding(servicer: SnapshotServicer) -> ServiceBinding:
    return ServiceBinding(
        snapshot_pb2_grpc.add_SnapshotServiceServicer_to_server,
        servicer,
        snapshot_pb2.DESCRIPTOR.services_by_name["SnapshotService"].full_name,
    )
