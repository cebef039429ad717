"""The node agent's composition root: discover GPUs, serve AgentService, stay registered.

The agent is ready (sd_notify READY, port file) as soon as its own server listens: a daemon
that is down must not keep a node's agent from starting, it only delays registration.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from fleetshift.v1 import agent_pb2
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_agent import service
from fleetshift_agent.discovery import DECLARED, Inventory, discover, package_version
from fleetshift_agent.membership import Backoff, Membership
from fleetshift_common.config import AgentConfig
from fleetshift_common.lifecycle import write_port_file
from fleetshift_common.sdnotify import SdNotifier, watchdog_interval
from fleetshift_rpc.auth import ServerSecurity, server_security
from fleetshift_rpc.metrics import AgentMetrics, MetricsEndpoint, start_metrics_server
from fleetshift_rpc.ratelimit import RateLimit
from fleetshift_rpc.security import PrincipalKind
from fleetshift_rpc.server import RunningServer, start_server

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
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
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
        self.server = await start_server(
            cfg.listen,
            [service.binding(self._info)],
            cfg.max_message_bytes,
            self.security.credentials,
            self.security.interceptors,
        )
        if cfg.metrics_listen:
            host, _, port = cfg.metrics_listen.rpartition(":")
            self.metrics_endpoint = start_metrics_server(self.metrics.registry, int(port), host)
        tls = self.security.tls
        self.membership = Membership(
            cfg.daemon_address,
            self._registration,
            self._heartbeat,
            Backoff(cfg.reconnect_initial_s, cfg.reconnect_max_s),
            cfg.max_message_bytes,
            tls.channel_credentials() if tls else None,
        )
        self._tasks.append(asyncio.create_task(self.membership.run()))
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
        return pb.HeartbeatRequest(node_name=self.config.node_name)

    def _info(self) -> agent_pb2.AgentInfo:
        return agent_pb2.AgentInfo(
            node_name=self.config.node_name,
            gpus=self._gpus(),
            versions=self._versions(),
            inventory_source=self._source(),  # type: ignore[arg-type]
            daemon_address=self.config.daemon_address,
            registered=bool(self.membership and self.membership.registered.is_set()),
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
