"""The agent's own gRPC API (``AgentService``), called by the daemon and by other agents.

It answers what the node is, and carries out the worker steps a move is made of: start a
worker (cold from a model directory, or warm from a snapshot of this node's store), stop it,
snapshot it into the store, and pull a snapshot from another agent. Requests are checked here,
so a bad one fails with the field it got wrong before any process is spawned; the supervisor
and the snapshot library do the work.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import worker_pb2 as wpb
from fleetshift.v1 import worker_pb2_grpc as wpb_grpc
from fleetshift_agent.engines import EngineSupport
from fleetshift_agent.restore_compat import restore_note
from fleetshift_agent.snapshot import RetentionPolicy, SnapshotExists, SnapshotStore
from fleetshift_agent.snapshot.transfer import fetch_snapshot
from fleetshift_agent.supervisor import Supervisor, WorkerLaunch
from fleetshift_agent.wire import ROLE_NAME_BY_PB
from fleetshift_common.bounds import check_host_port
from fleetshift_common.compat import CompatKey, compare
from fleetshift_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from fleetshift_rpc.errors import rpc_errors
from fleetshift_rpc.metrics import AgentMetrics
from fleetshift_rpc.server import ServiceBinding, channel

log = logging.getLogger("fleetshift.agent")

WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
ROLE_NAMES = ROLE_NAME_BY_PB
DTYPES = ("bf16", "fp8", "int4_w")
DEFAULT_GRACE_S = 5.0
T = TypeVar("T")


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(
        self,
        info: Callable[[], agent_pb2.AgentInfo],
        supervisor: Supervisor,
        store: SnapshotStore,
        *,
        peer_credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 4 << 20,
        retention: RetentionPolicy | None = None,
        metrics: AgentMetrics | None = None,
        engines: EngineSupport | None = None,
    ) -> None:
        self._engines = engines or EngineSupport()
        self._metrics = metrics or AgentMetrics(node="")
        self._info = info
        self._supervisor = supervisor
        self._store = store
        self._peer_credentials = peer_credentials
        self._max_message_bytes = max_message_bytes
        self._retention = retention

    @rpc_errors
    async def GetAgentInfo(
        self, request: agent_pb2.GetAgentInfoRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.AgentInfo:
        return self._info()

    # -- workers ---------------------------------------------------------------------------
    @rpc_errors
    async def StartWorker(
        self, request: agent_pb2.StartWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerStatus:
        with ExitStack() as held:
            launch = self._launch(request, held)
            started = time.monotonic()
            worker = await self._supervisor.start(launch)
            status = self._supervisor.status(worker)
            if launch.origin_snapshot:  # a warm start: the restore the dashboard times
                size = self._store.summary(launch.origin_snapshot).size_bytes
                self._metrics.snapshot_restored(time.monotonic() - started, size)
                key = self._store.get(launch.origin_snapshot).key  # still held: not deleted
                status.restore_compat = await _restore_verdict(
                    key, self._supervisor.settings.channel(worker.endpoint)
                )
        return status

    def _launch(self, request: agent_pb2.StartWorkerRequest, held: ExitStack) -> WorkerLaunch:
        """Check the request; a warm start holds its snapshot (no deletion) in ``held``."""
        if not WORKER_ID.fullmatch(request.worker_id):
            raise InvalidArgument(
                f"worker_id {request.worker_id!r} must match {WORKER_ID.pattern}",
                field="worker_id",
            )
        role = ROLE_NAMES.get(request.role)
        if role is None:
            raise InvalidArgument("role must be PREFILL, DECODE or MIXED", field="role")
        dtype = request.dtype or "bf16"
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {DTYPES}, got {dtype!r}", field="dtype")
        gpus = tuple(request.gpu_indices)
        if not gpus or len(set(gpus)) != len(gpus):
            raise InvalidArgument(
                f"gpu_indices must name distinct GPUs, got {list(gpus)}", field="gpu_indices"
            )
        engine = request.engine or "reference"
        self._engines.check(engine, request.engine_args_json)
        launch = WorkerLaunch(
            worker_id=request.worker_id,
            model=request.model,
            role=role,
            gpu_indices=gpus,
            tp=request.tensor_parallel or len(gpus),
            dtype=dtype,
            engine=engine,
            engine_args_json=request.engine_args_json,
        )
        self._supervisor.check(launch)
        if request.restore_snapshot_id:
            sid = request.restore_snapshot_id
            snap = _renamed(
                "restore_snapshot_id", lambda: held.enter_context(self._store.using(sid))
            )
            snap.check_listing()  # refused here, naming the file, not by a worker that dies
            return replace(
                launch,
                model=launch.model or snap.key.model_id,
                restore_from=str(snap.path),
                origin_snapshot=sid,
            )
        if not request.model_dir or not Path(request.model_dir).is_dir():
            raise FailedPrecondition(
                f"model_dir {request.model_dir!r} is not a directory on this node",
                field="model_dir",
            )
        return replace(
            launch,
            model=launch.model or Path(request.model_dir).name,
            model_dir=request.model_dir,
        )

    @rpc_errors
    async def StopWorker(
        self, request: agent_pb2.StopWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.WorkerStatus:
        if request.grace_s < 0:
            raise InvalidArgument("grace_s must be >= 0", field="grace_s")
        worker = await self._supervisor.stop(request.worker_id, request.grace_s or DEFAULT_GRACE_S)
        return self._supervisor.status(worker)

    # -- snapshots -------------------------------------------------------------------------
    @rpc_errors
    async def SnapshotWorker(
        self, request: agent_pb2.SnapshotWorkerRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.SnapshotWorkerResponse:
        sid = request.snapshot_id
        path = _renamed("snapshot_id", lambda: self._store.path(sid))
        self._supervisor.serving(request.worker_id)
        if path.exists():
            raise AlreadyExists(f"snapshot_id {sid!r} is already in the store", field="snapshot_id")
        started = time.monotonic()
        reply = await self._supervisor.snapshot(request.worker_id, self._store.root, sid)
        written = self._store.summary(sid)  # visible (and readable) before the caller hears
        self._metrics.snapshot_written(time.monotonic() - started, written.size_bytes)
        await asyncio.to_thread(self._retain, sid)
        return agent_pb2.SnapshotWorkerResponse(
            snapshot_id=sid,
            size_bytes=reply.size_bytes,
            pause_ms=reply.pause_ms,
            total_ms=reply.total_ms,
            session_ids=list(reply.session_ids),
        )

    @rpc_errors
    async def FetchSnapshot(
        self, request: agent_pb2.FetchSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.FetchSnapshotResponse:
        sid = request.snapshot_id
        path = _renamed("snapshot_id", lambda: self._store.path(sid))
        if not request.source_agent_address:
            raise InvalidArgument(
                "source_agent_address must not be empty", field="source_agent_address"
            )
        check_host_port("source_agent_address", request.source_agent_address)
        started = time.monotonic()
        if path.exists():  # idempotent: a retried step finds the work done
            return agent_pb2.FetchSnapshotResponse(
                snapshot_id=sid, size_bytes=self._store.summary(sid).size_bytes
            )
        try:
            received = await self._fetch(request.source_agent_address, sid)
        except SnapshotExists:  # a concurrent fetch of the same snapshot finished first
            received = 0
        self._metrics.transferred("received", received)
        await self._supervisor.hit("agent:fetch:received")  # in the store, not yet answered
        await asyncio.to_thread(self._retain, sid)
        return agent_pb2.FetchSnapshotResponse(
            snapshot_id=sid,
            bytes_received=received,
            size_bytes=self._store.summary(sid).size_bytes,
            seconds=time.monotonic() - started,
        )

    def _retain(self, newest: str) -> None:
        """Apply the retention policy; never to the snapshot this call just made or fetched."""
        if self._retention is None:
            return
        with self._store.using(newest):
            deleted = self._store.apply_retention(self._retention)
        if deleted:
            log.info("snapshot retention deleted %s", deleted)

    async def _fetch(self, source: str, snapshot_id: str) -> int:
        """Pull into the store over mTLS when this agent has credentials; bytes received."""
        if self._peer_credentials is None:
            report = await fetch_snapshot(source, snapshot_id, self._store)
        else:
            async with channel(source, self._max_message_bytes, self._peer_credentials) as ch:
                report = await fetch_snapshot(ch, snapshot_id, self._store)
        return report.bytes_received


async def _restore_verdict(snapshot: CompatKey, worker: grpc.aio.Channel) -> str:
    """The restore that happened: the snapshot's key against the started worker's own."""
    try:
        async with worker as ch:
            info = await wpb_grpc.WorkerServiceStub(ch).GetInfo(
                wpb.GetWorkerInfoRequest(), timeout=10
            )
    except grpc.aio.AioRpcError as err:
        return f"unknown: the worker did not report its key ({err.code().name})"
    worker_key = CompatKey(**{n: getattr(info.compat_key, n) for n in CompatKey.field_names()})
    return restore_note(compare(snapshot, worker_key))


def _renamed(field: str, fn: Callable[[], T]) -> T:
    """Call into the store; its errors name the request's field, not the library's."""
    try:
        return fn()
    except NotFound as err:
        raise NotFound(f"{field}: {err.message}", field=field) from None
    except InvalidArgument as err:
        raise InvalidArgument(f"{field}: {err.message}", field=field) from None


def binding(servicer: AgentServicer) -> ServiceBinding:
    return ServiceBinding(
        agent_pb2_grpc.add_AgentServiceServicer_to_server,
        servicer,
        agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    )


__all__ = ["AgentServicer", "binding"]
