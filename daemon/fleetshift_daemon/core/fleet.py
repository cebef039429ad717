"""Value types of the fleet registry, shared by the registry core, the store and the API layer.

They are frozen so the in-memory view can hand them to the hot paths (routing, listing) without
copies or locks: a change replaces the record instead of mutating it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class NodeState(enum.Enum):
    READY = "ready"
    LOST = "lost"  # missed heartbeats for longer than the configured timeout


class InventorySource(enum.Enum):
    NVML = "nvml"  # discovered on the hardware
    DECLARED = "declared"  # written in the agent's config


@dataclass(frozen=True)
class GpuInfo:
    index: int
    product_name: str
    memory_bytes: int
    bandwidth_class: str = ""
    compute_capability: str = ""
    fp8_supported: bool = False
    nvlink_peers: tuple[int, ...] = ()
    uuid: str = ""


@dataclass(frozen=True)
class NodeVersions:
    driver: str = ""
    cuda: str = ""
    torch: str = ""
    agent: str = ""


@dataclass(frozen=True)
class Registration:
    node_name: str
    agent_address: str
    gpus: tuple[GpuInfo, ...]
    versions: NodeVersions = NodeVersions()
    inventory_source: InventorySource = InventorySource.NVML


@dataclass(frozen=True)
class WorkerCounters:
    """Per-step counters a worker reports through its agent's heartbeat."""

    worker_id: str
    prefill_tokens: int = 0
    decode_tokens: int = 0
    queue_depth: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    live_sessions: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    tbt_p50_ms: float = 0.0
    tbt_p99_ms: float = 0.0


@dataclass(frozen=True)
class NodeRecord:
    name: str
    agent_address: str
    state: NodeState
    inventory_source: InventorySource
    versions: NodeVersions
    gpus: tuple[GpuInfo, ...]
    registered_at: float
    last_heartbeat_at: float | None = None
    cordoned: bool = False
    cordon_reason: str = ""
    workers: tuple[WorkerCounters, ...] = field(default=(), compare=False)

    @property
    def gpu_products(self) -> tuple[str, ...]:
        return tuple(sorted({g.product_name for g in self.gpus}))
