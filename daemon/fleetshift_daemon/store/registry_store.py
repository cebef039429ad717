"""SQL implementation of the registry core's ``RegistryStore``.

Each method is one short transaction; the core decides when to call them, so this module only
translates between rows and the core's frozen records.

Among daemon replicas (docs/replicas.md) the registry's writes are of two kinds:

- the leader's decisions (a node lost or back, a cordon, the batched heartbeat times) carry
  the fencing token like every executor write (``lease_store.check_fence``): a deposed
  leader's are refused by the database and roll back;
- a registration is the agent's own statement about itself (address, inventory, versions),
  accepted by whichever replica it reaches. It is not fenced, and it never writes what the
  leader decides: an existing node's cordon stays as the database has it, so a follower whose
  view has not caught up with a cordon cannot undo it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeRecord,
    NodeState,
    NodeVersions,
)
from fleetshift_daemon.store.lease_store import Fence, check_fence
from fleetshift_daemon.store.models import GpuRow, NodeRow


def _to_dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


def _to_ts(dt: datetime | None) -> float | None:
    if dt is None:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


class SqlRegistryStore:
    def __init__(self, engine: Engine, fence: Fence | None = None) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence

    def load_nodes(self) -> list[NodeRecord]:
        """Every node with its GPUs, read as plain rows in two statements: a follower does this
        on every registry change and at each full read, and through the ORM's unit of work
        1,000 nodes and their 8,000 GPUs took twice the CPU (bench/registry_reads.py)."""
        nodes, gpus = NodeRow.__table__, GpuRow.__table__
        with self._sessions() as session:
            node_rows = session.execute(select(nodes).order_by(nodes.c.id)).all()
            gpu_rows = session.execute(select(gpus).order_by(gpus.c.node_id, gpus.c.index)).all()
        by_node: dict[int, list[Any]] = defaultdict(list)
        for gpu in gpu_rows:
            by_node[gpu.node_id].append(gpu)
        return [_record(row, by_node[row.id]) for row in node_rows]

    def save_node(self, node: NodeRecord) -> None:
        try:
            self._save_node(node)
        except IntegrityError:
            # Daemon replicas: an agent registers with each, and two may insert the same new
            # node at once; the loser finds the winner's row and updates it.
            self._save_node(node)

    def _save_node(self, node: NodeRecord) -> None:
        with self._sessions.begin() as session:
            row = session.scalar(select(NodeRow).where(NodeRow.name == node.name))
            if row is None:
                row = NodeRow(
                    name=node.name, cordoned=node.cordoned, cordon_reason=node.cordon_reason
                )
                session.add(row)
            _fill(row, node)
            # Old GPU rows go first: the unit of work would insert before it deletes and trip
            # the (node_id, index) unique constraint on a re-registration.
            row.gpus.clear()
            session.flush()
            row.gpus.extend(_gpu_row(g) for g in node.gpus)

    def update_status(self, name: str, state: NodeState, cordoned: bool, reason: str) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            session.execute(
                update(NodeRow)
                .where(NodeRow.name == name)
                .values(state=state.value, cordoned=cordoned, cordon_reason=reason)
            )

    def record_heartbeats(self, seen: Mapping[str, float]) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            for name, ts in seen.items():
                session.execute(
                    update(NodeRow).where(NodeRow.name == name).values(last_heartbeat_at=_to_dt(ts))
                )


def _fill(row: NodeRow, node: NodeRecord) -> None:
    row.agent_address = node.agent_address
    row.state = node.state.value
    row.inventory_source = node.inventory_source.value
    row.driver_version = node.versions.driver
    row.cuda_version = node.versions.cuda
    row.torch_version = node.versions.torch
    row.agent_version = node.versions.agent
    row.registered_at = _to_dt(node.registered_at)  # type: ignore[assignment]
    row.last_heartbeat_at = _to_dt(node.last_heartbeat_at)


def _gpu_row(gpu: GpuInfo) -> GpuRow:
    return GpuRow(
        index=gpu.index,
        product_name=gpu.product_name,
        memory_bytes=gpu.memory_bytes,
        bandwidth_class=gpu.bandwidth_class,
        compute_capability=gpu.compute_capability,
        fp8_supported=gpu.fp8_supported,
        nvlink_peers=",".join(str(p) for p in gpu.nvlink_peers),
        uuid=gpu.uuid,
    )


def _record(row: Any, gpus: Iterable[Any]) -> NodeRecord:
    """A node's record from its row and its GPUs' rows (ORM objects or plain rows alike)."""
    return NodeRecord(
        name=row.name,
        agent_address=row.agent_address,
        state=NodeState(row.state),
        inventory_source=InventorySource(row.inventory_source),
        versions=NodeVersions(
            driver=row.driver_version,
            cuda=row.cuda_version,
            torch=row.torch_version,
            agent=row.agent_version,
        ),
        gpus=tuple(
            GpuInfo(
                index=g.index,
                product_name=g.product_name,
                memory_bytes=g.memory_bytes,
                bandwidth_class=g.bandwidth_class,
                compute_capability=g.compute_capability,
                fp8_supported=g.fp8_supported,
                nvlink_peers=tuple(int(p) for p in g.nvlink_peers.split(",") if p),
                uuid=g.uuid,
            )
            for g in gpus
        ),
        registered_at=_to_ts(row.registered_at) or 0.0,
        last_heartbeat_at=_to_ts(row.last_heartbeat_at),
        cordoned=row.cordoned,
        cordon_reason=row.cordon_reason,
    )
