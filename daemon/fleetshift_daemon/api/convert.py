"""Conversions between fleetshift.v1 messages and the core's records (no logic here)."""

from __future__ import annotations

from typing import Protocol, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_daemon.core.engine_fit import TpFit
from fleetshift_daemon.core.estimator import Completion
from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeRecord,
    NodeState,
    NodeVersions,
    Registration,
    WorkerCounters,
)
from fleetshift_daemon.core.placement import PlacementService
from fleetshift_daemon.core.workers import WorkerRecord, WorkerReport, WorkerSpec, WorkerState
from fleetshift_daemon.wire import ROLE_TO_PB as ROLE_TO_PB  # re-exported for the servicers
from fleetshift_daemon.wire import WORKER_STATE_FROM_PB as WORKER_STATE_FROM_PB
from fleetshift_daemon.wire import WORKER_STATE_TO_PB as WORKER_STATE_TO_PB
from fleetshift_daemon.wire import dtype as dtype
from fleetshift_daemon.wire import role as role

_SOURCE_TO_PB = {
    InventorySource.NVML: pb.INVENTORY_SOURCE_NVML,
    InventorySource.DECLARED: pb.INVENTORY_SOURCE_DECLARED,
}
_STATE_TO_PB = {NodeState.READY: pb.NODE_STATE_READY, NodeState.LOST: pb.NODE_STATE_LOST}
STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def node_state_pb(state: NodeState) -> pb.NodeState:
    return _STATE_TO_PB[state]


def registration(msg: pb.RegisterNodeRequest) -> Registration:
    source = (
        InventorySource.DECLARED
        if msg.inventory_source == pb.INVENTORY_SOURCE_DECLARED
        else InventorySource.NVML
    )
    return Registration(
        node_name=msg.node_name,
        agent_address=msg.agent_address,
        gpus=tuple(gpu(g) for g in msg.gpus),
        versions=NodeVersions(
            driver=msg.versions.driver,
            cuda=msg.versions.cuda,
            torch=msg.versions.torch,
            agent=msg.versions.agent,
        ),
        inventory_source=source,
    )


def gpu(msg: pb.Gpu) -> GpuInfo:
    return GpuInfo(
        index=msg.index,
        product_name=msg.product_name,
        memory_bytes=msg.memory_bytes,
        bandwidth_class=msg.bandwidth_class,
        compute_capability=msg.compute_capability,
        fp8_supported=msg.fp8_supported,
        nvlink_peers=tuple(msg.nvlink_peers),
        uuid=msg.uuid,
    )


def gpu_pb(info: GpuInfo) -> pb.Gpu:
    return pb.Gpu(
        index=info.index,
        product_name=info.product_name,
        memory_bytes=info.memory_bytes,
        bandwidth_class=info.bandwidth_class,
        compute_capability=info.compute_capability,
        fp8_supported=info.fp8_supported,
        nvlink_peers=list(info.nvlink_peers),
        uuid=info.uuid,
    )


def counters(msg: pb.WorkerCounters, worker_id: str = "") -> WorkerCounters:
    return WorkerCounters(
        worker_id=msg.worker_id or worker_id,
        prefill_tokens=msg.prefill_tokens,
        decode_tokens=msg.decode_tokens,
        queue_depth=msg.queue_depth,
        kv_blocks_used=msg.kv_blocks_used,
        kv_blocks_total=msg.kv_blocks_total,
        live_sessions=msg.live_sessions,
        ttft_p50_ms=msg.ttft_p50_ms,
        ttft_p99_ms=msg.ttft_p99_ms,
        tbt_p50_ms=msg.tbt_p50_ms,
        tbt_p99_ms=msg.tbt_p99_ms,
    )


def timestamp(ts: float | None) -> Timestamp | None:
    """Seconds since the epoch (the core's clock) as a protobuf Timestamp; None stays unset."""
    if ts is None:
        return None
    out = Timestamp()
    out.FromNanoseconds(int(ts * 1e9))
    return out


def node_pb(node: NodeRecord) -> pb.Node:
    return pb.Node(
        name=node.name,
        agent_address=node.agent_address,
        state=_STATE_TO_PB[node.state],
        cordoned=node.cordoned,
        cordon_reason=node.cordon_reason,
        inventory_source=_SOURCE_TO_PB[node.inventory_source],
        versions=pb.NodeVersions(
            driver=node.versions.driver,
            cuda=node.versions.cuda,
            torch=node.versions.torch,
            agent=node.versions.agent,
        ),
        gpus=[gpu_pb(g) for g in node.gpus],
        registered_at=timestamp(node.registered_at),
        last_heartbeat_at=timestamp(node.last_heartbeat_at),
    )


def worker_report(msg: pb.WorkerStatus, where: str = "workers") -> WorkerReport:
    spec = WorkerSpec(
        model=msg.model,
        role=role(msg.role, f"{where}.role"),
        tp=msg.tensor_parallel or 1,
        dtype=dtype(msg.dtype, f"{where}.dtype"),
    )
    return WorkerReport(
        worker_id=msg.worker_id,
        spec=spec,
        gpu_indices=tuple(msg.gpu_indices),
        endpoint=msg.endpoint,
        state=WORKER_STATE_FROM_PB.get(msg.state, WorkerState.SERVING),
        origin_snapshot=msg.origin_snapshot,
        counters=counters(msg.counters, msg.worker_id) if msg.HasField("counters") else None,
        sessions=tuple(msg.session_ids),
        unread=tuple(msg.unread_session_ids),
        role_epoch=msg.role_epoch,
        finished=tuple(
            Completion(f.session_id, f.prompt_tokens, f.output_tokens)
            for f in msg.finished_sessions
        ),
    )


def worker_pb(worker: WorkerRecord) -> pb.WorkerStatus:
    out = pb.WorkerStatus(
        worker_id=worker.id,
        model=worker.spec.model,
        role=ROLE_TO_PB[worker.spec.role],
        tensor_parallel=worker.spec.tp,
        dtype=worker.spec.dtype.value,
        gpu_indices=list(worker.gpu_indices),
        endpoint=worker.endpoint,
        state=WORKER_STATE_TO_PB[worker.state],
        origin_snapshot=worker.origin_snapshot,
        session_ids=list(worker.sessions),
        role_epoch=worker.role_epoch,
        node_name=worker.node,
    )
    if worker.counters is not None:
        out.counters.CopyFrom(counters_pb(worker.counters))
    return out


class _EngineFields(Protocol):
    model: str
    node_name: str
    tensor_parallel: int
    engine: str
    tensor_parallel_nominal: bool


M = TypeVar("M", bound=_EngineFields)


def with_engine(msg: M, placement: PlacementService) -> M:
    """Fill a worker's (or planned worker's) engine, and whether its TP is nominal: an engine
    that computes on one device, on a declared inventory (``core.engine_fit``)."""
    served = placement.models.get(msg.model)
    msg.engine = served.engine if served else ""
    fit = placement.tp_fit(msg.model, msg.node_name, msg.tensor_parallel)
    msg.tensor_parallel_nominal = fit is TpFit.NOMINAL
    return msg


def counters_pb(c: WorkerCounters) -> pb.WorkerCounters:
    return pb.WorkerCounters(
        worker_id=c.worker_id,
        prefill_tokens=c.prefill_tokens,
        decode_tokens=c.decode_tokens,
        queue_depth=c.queue_depth,
        kv_blocks_used=c.kv_blocks_used,
        kv_blocks_total=c.kv_blocks_total,
        live_sessions=c.live_sessions,
        ttft_p50_ms=c.ttft_p50_ms,
        ttft_p99_ms=c.ttft_p99_ms,
        tbt_p50_ms=c.tbt_p50_ms,
        tbt_p99_ms=c.tbt_p99_ms,
    )
