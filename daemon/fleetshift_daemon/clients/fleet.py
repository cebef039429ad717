"""How the daemon talks to agents and workers: the one gRPC implementation of ``FleetClient``.

All protobuf for those conversations is built here, and every refusal from a peer goes through
the error catalogue (``fleetshift_rpc.errors.peer_error``): the phase machine and, through the
operation log, an operator see one sentence naming the peer and what it said, never a wire
dump (``AioRpcError``'s text carries ``debug_error_string``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift_common.errors import FailedPrecondition, FleetShiftError
from fleetshift_common.vocabulary import Role
from fleetshift_daemon.core.fleet_client import (
    AgentRef,
    ExportedSession,
    SessionEnded,
    WorkerAlreadyRuns,
    WorkerGone,
    WorkerLaunch,
    WorkerRef,
)
from fleetshift_daemon.wire import ROLE_TO_PB
from fleetshift_rpc.errors import peer_error
from fleetshift_rpc.server import channel

RPC_TIMEOUT_S = 30.0
START_TIMEOUT_S = 600.0  # a cold start loads weights; a warm one restores a snapshot

# An agent's answers that mean the same to the daemon's caller; others fail the call as a
# failed precondition (the daemon refused by an agent's TLS is not the operator's problem).
AGENT_PASSES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
WORKER_PASSES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
T = TypeVar("T")


def agent_peer(agent: AgentRef) -> str:
    return f"agent of node {agent.node!r}"


def worker_peer(worker: WorkerRef) -> str:
    return f"worker {worker.worker_id!r}"


@dataclass
class GrpcFleetClient:
    """gRPC channels to agents and workers, one per address, reused across steps.

    Worker channels take much larger messages than the daemon's own API: an exported session
    carries its KV cache (tens of KB per token), so one long session is easily 100 MB."""

    max_message_bytes: int
    credentials: grpc.ChannelCredentials | None = None
    session_blob_bytes: int = 1 << 30
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)

    def _channel(self, address: str, limit: int | None = None) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(
                address, limit or self.max_message_bytes, self.credentials
            )
        return self._channels[address]

    def _agent(self, agent: AgentRef) -> agent_pb2_grpc.AgentServiceStub:
        return agent_pb2_grpc.AgentServiceStub(self._channel(agent.address))

    def _worker(self, worker: WorkerRef) -> worker_pb2_grpc.WorkerServiceStub:
        return worker_pb2_grpc.WorkerServiceStub(
            self._channel(worker.endpoint, self.session_blob_bytes)
        )

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    # -- agents ---------------------------------------------------------------------------
    async def start_worker(self, agent: AgentRef, launch: WorkerLaunch) -> str:
        request = agent_pb2.StartWorkerRequest(
            worker_id=launch.worker_id,
            model=launch.model,
            model_dir=launch.model_dir,
            role=ROLE_TO_PB[launch.role],
            tensor_parallel=launch.tp,
            dtype=launch.dtype.value,
            gpu_indices=list(launch.gpu_indices),
            restore_snapshot_id=launch.restore_snapshot_id,
            engine=launch.engine,
            engine_args_json=launch.engine_args_json,
        )
        status = await _agent_call(
            agent,
            lambda: self._agent(agent).StartWorker(request, timeout=START_TIMEOUT_S),
            {grpc.StatusCode.ALREADY_EXISTS: WorkerAlreadyRuns},
        )
        return str(status.endpoint)

    async def worker_endpoint(self, agent: AgentRef, worker_id: str) -> str:
        info = await _agent_call(
            agent,
            lambda: self._agent(agent).GetAgentInfo(
                agent_pb2.GetAgentInfoRequest(), timeout=RPC_TIMEOUT_S
            ),
        )
        for worker in info.workers:
            if worker.worker_id == worker_id:
                return str(worker.endpoint)
        raise WorkerGone(f"{agent_peer(agent)}: runs no worker {worker_id!r}", field="worker_id")

    async def stop_worker(self, agent: AgentRef, worker_id: str) -> None:
        await _agent_call(
            agent,
            lambda: self._agent(agent).StopWorker(
                agent_pb2.StopWorkerRequest(worker_id=worker_id), timeout=RPC_TIMEOUT_S
            ),
            {grpc.StatusCode.NOT_FOUND: WorkerGone},
        )

    async def snapshot_worker(self, agent: AgentRef, worker_id: str, snapshot_id: str) -> int:
        reply = await _agent_call(
            agent,
            lambda: self._agent(agent).SnapshotWorker(
                agent_pb2.SnapshotWorkerRequest(worker_id=worker_id, snapshot_id=snapshot_id),
                timeout=START_TIMEOUT_S,
            ),
        )
        return int(reply.size_bytes)

    async def fetch_snapshot(self, agent: AgentRef, source: AgentRef, snapshot_id: str) -> None:
        await _agent_call(
            agent,
            lambda: self._agent(agent).FetchSnapshot(
                agent_pb2.FetchSnapshotRequest(
                    source_agent_address=source.address, snapshot_id=snapshot_id
                ),
                timeout=START_TIMEOUT_S,
            ),
        )

    # -- workers --------------------------------------------------------------------------
    async def pause(self, worker: WorkerRef) -> None:
        await _worker_call(
            worker,
            lambda: self._worker(worker).Pause(
                worker_pb2.WorkerPauseRequest(), timeout=RPC_TIMEOUT_S
            ),
        )

    async def resume(self, worker: WorkerRef) -> None:
        await _worker_call(
            worker,
            lambda: self._worker(worker).Resume(
                worker_pb2.WorkerResumeRequest(), timeout=RPC_TIMEOUT_S
            ),
        )

    async def session_ids(self, worker: WorkerRef) -> tuple[str, ...]:
        info = await _worker_call(
            worker,
            lambda: self._worker(worker).GetInfo(
                worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S
            ),
        )
        return tuple(info.session_ids)

    async def live_sessions(self, worker: WorkerRef) -> int:
        counters = await _worker_call(
            worker,
            lambda: self._worker(worker).GetCounters(
                worker_pb2.GetWorkerCountersRequest(), timeout=RPC_TIMEOUT_S
            ),
        )
        return int(counters.live_sessions)

    async def export_session(
        self, worker: WorkerRef, session_id: str, *, with_kv: bool, from_token: int = 0
    ) -> ExportedSession:
        request = worker_pb2.ExportSessionRequest(
            session_id=session_id, with_kv=with_kv, release=False, from_token=from_token
        )
        reply = await _worker_call(
            worker,
            lambda: self._worker(worker).ExportSession(request, timeout=RPC_TIMEOUT_S),
            {grpc.StatusCode.FAILED_PRECONDITION: SessionEnded},
        )
        return ExportedSession(bytes(reply.blob), int(reply.tokens), bool(reply.kv_included))

    async def import_session(
        self, worker: WorkerRef, blob: bytes, *, delta_for: str = "", staged: bool = False
    ) -> bool:
        request = worker_pb2.ImportSessionRequest(blob=blob, delta_for=delta_for, staged=staged)
        reply = await _worker_call(
            worker, lambda: self._worker(worker).ImportSession(request, timeout=RPC_TIMEOUT_S)
        )
        return bool(reply.kv_restored)

    async def cancel_session(self, worker: WorkerRef, session_id: str) -> None:
        await _worker_call(
            worker,
            lambda: self._worker(worker).CancelSession(
                worker_pb2.CancelSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S
            ),
        )

    async def set_role(self, worker: WorkerRef, role: Role) -> int:
        info = await _worker_call(
            worker,
            lambda: self._worker(worker).SetRole(
                worker_pb2.SetWorkerRoleRequest(role=ROLE_TO_PB[role]), timeout=RPC_TIMEOUT_S
            ),
        )
        return int(info.role_epoch)

    async def set_draining(self, worker: WorkerRef, draining: bool) -> None:
        await _worker_call(
            worker,
            lambda: self._worker(worker).SetDraining(
                worker_pb2.SetWorkerDrainingRequest(draining=draining), timeout=RPC_TIMEOUT_S
            ),
        )


Special = dict[grpc.StatusCode, type[FleetShiftError]]


async def _agent_call(
    agent: AgentRef, call: Callable[[], Awaitable[T]], special: Special | None = None
) -> T:
    return await _call(agent_peer(agent), "node_name", AGENT_PASSES, call, special)


async def _worker_call(
    worker: WorkerRef, call: Callable[[], Awaitable[T]], special: Special | None = None
) -> T:
    return await _call(worker_peer(worker), "worker_id", WORKER_PASSES, call, special)


async def _call(
    peer: str,
    field_name: str,
    passes: Collection[grpc.StatusCode],
    call: Callable[[], Awaitable[T]],
    special: Special | None,
) -> T:
    """One call to a peer; its refusal becomes the catalogue's typed error (or, for the codes
    in ``special``, the domain error the phase machine acts on), with the peer named."""
    try:
        return await call()
    except grpc.aio.AioRpcError as err:
        mapped = peer_error(err, peer, passes=passes, default=FailedPrecondition, field=field_name)
        cls = (special or {}).get(err.code())
        raise (cls(mapped.message, field=field_name) if cls else mapped) from None
