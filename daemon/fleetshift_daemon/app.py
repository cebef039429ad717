"""The central daemon's composition root: config in, a running gRPC server out.

Everything with a lifetime (database engine, registry view, gRPC server, periodic jobs, the
systemd watchdog) is created and stopped here, in one order, so no module holds a global.
Readiness is announced (health SERVING, sd_notify READY, port file) only after the schema is
upgraded and the registry is loaded: a client that sees the daemon ready sees every node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy import Engine

from fleetshift_common.config import DaemonConfig
from fleetshift_common.lifecycle import write_port_file
from fleetshift_common.sdnotify import SdNotifier, watchdog_interval
from fleetshift_daemon.api import fleet as fleet_api
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_rpc.server import RunningServer, ServiceBinding, start_server

log = logging.getLogger("fleetshift.daemon")


@dataclass
class Daemon:
    config: DaemonConfig
    clock: Callable[[], float] = time.time
    notifier: SdNotifier = field(default_factory=SdNotifier.from_env)
    engine: Engine | None = None
    registry: Registry | None = None
    server: RunningServer | None = None
    _scheduler: AsyncIOScheduler | None = None
    _watchdog: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        assert self.server is not None, "daemon not started"
        return self.server.port

    async def start(self) -> None:
        cfg = self.config
        self.engine = make_engine(cfg.effective_database_url)
        await asyncio.to_thread(upgrade, self.engine)
        self.registry = Registry(SqlRegistryStore(self.engine), self.clock, cfg.node_lost_after_s)
        await asyncio.to_thread(self.registry.load)
        self.server = await start_server(cfg.listen, self._bindings(), cfg.max_message_bytes)
        self._start_jobs()
        await self.server.set_serving(True)
        write_port_file(cfg.port_file, self.server.port)
        self.notifier.ready(f"serving on port {self.server.port}")
        log.info(
            "daemon ready",
            extra={"port": self.server.port, "nodes": len(self.registry.nodes())},
        )

    def _bindings(self) -> list[ServiceBinding]:
        assert self.registry is not None
        interval_ms = int(self.config.heartbeat_interval_s * 1000)
        return fleet_api.bindings(self.registry, interval_ms)

    def _start_jobs(self) -> None:
        scheduler = AsyncIOScheduler()
        scheduler.add_job(
            self._sweep,
            "interval",
            seconds=self.config.liveness_check_interval_s,
            id="liveness-sweep",
            max_instances=1,
            coalesce=True,
        )
        scheduler.start()
        self._scheduler = scheduler
        interval = watchdog_interval()
        if interval:
            self._watchdog = asyncio.create_task(self._ping_watchdog(interval))

    async def _sweep(self) -> None:
        assert self.registry is not None
        try:
            turned = await asyncio.to_thread(self.registry.sweep)
        except Exception:
            log.exception("liveness sweep failed; retrying at the next interval")
            return
        for name in turned:
            log.warning("node lost: no heartbeat within the timeout", extra={"node": name})

    async def _ping_watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def stop(self, grace_s: float = 2.0) -> None:
        self.notifier.stopping()
        if self._watchdog:
            self._watchdog.cancel()
        if self._scheduler:
            self._scheduler.shutdown(wait=False)
        if self.server:
            await self.server.set_serving(False)
            await self.server.server.stop(grace_s)
        if self.registry:
            await asyncio.to_thread(self.registry.sweep)  # flush heartbeat times
        if self.engine:
            self.engine.dispose()
