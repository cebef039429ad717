"""Conversions between fleetshift.v1 messages and the core's records (no logic here)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeRecord,
    NodeState,
    NodeVersions,
    Registration,
    WorkerCounters,
)

_SOURCE_TO_PB = {
    InventorySource.NVML: pb.INVENTORY_SOURCE_NVML,
    InventorySource.DECLARED: pb.INVENTORY_SOURCE_DECLARED,
}
_STATE_TO_PB = {NodeState.READY: pb.NODE_STATE_READY, NodeState.LOST: pb.NODE_STATE_LOST}
STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


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


def counters(msg: pb.WorkerCounters) -> WorkerCounters:
    return WorkerCounters(
        worker_id=msg.worker_id,
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


def _timestamp(ts: float | None) -> Timestamp | None:
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
        registered_at=_timestamp(node.registered_at),
        last_heartbeat_at=_timestamp(node.last_heartbeat_at),
    )
