"""SQL implementations of the worker table, the operation log and the efficiency history.

With a ``fence`` (the leader's token), every write checks the lease's current token in its own
transaction first (``lease_store.check_fence``), so a deposed leader's writes are refused by
the database. Followers never write here; without a fence (tools, tests) writes are plain.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import sessionmaker

from fleetshift_daemon.core.operations import (
    Operation,
    OperationKind,
    OperationState,
    Step,
)
from fleetshift_daemon.core.perfmodel import Dtype
from fleetshift_daemon.core.placement import EfficiencySample
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec, WorkerState
from fleetshift_daemon.store.lease_store import Fence, check_fence
from fleetshift_daemon.store.models import EfficiencySampleRow, OperationRow, WorkerRow
from fleetshift_daemon.store.registry_store import _to_dt, _to_ts


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


class SqlWorkerStore:
    def __init__(self, engine: Engine, fence: Fence | None = None) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence

    def load_workers(self) -> list[WorkerRecord]:
        with self._sessions() as session:
            return [_worker(row) for row in session.scalars(select(WorkerRow))]

    def save_worker(self, worker: WorkerRecord) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            row = session.get(WorkerRow, worker.id) or WorkerRow(id=worker.id)
            row.node_name = worker.node
            row.model = worker.spec.model
            row.role = worker.spec.role.value
            row.tensor_parallel = worker.spec.tp
            row.dtype = worker.spec.dtype.value
            row.gpu_indices = ",".join(str(i) for i in worker.gpu_indices)
            row.endpoint = worker.endpoint
            row.state = worker.state.value
            row.origin_snapshot = worker.origin_snapshot
            row.operation_id = worker.operation_id
            row.created_at = _to_dt(worker.created_at)  # type: ignore[assignment]
            session.merge(row)

    def delete_worker(self, worker_id: str) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            session.execute(delete(WorkerRow).where(WorkerRow.id == worker_id))


def _worker(row: WorkerRow) -> WorkerRecord:
    return WorkerRecord(
        id=row.id,
        node=row.node_name,
        spec=WorkerSpec(row.model, Role(row.role), row.tensor_parallel, Dtype(row.dtype)),
        gpu_indices=_ints(row.gpu_indices),
        endpoint=row.endpoint,
        state=WorkerState(row.state),
        created_at=_to_ts(row.created_at) or 0.0,
        origin_snapshot=row.origin_snapshot,
        operation_id=row.operation_id,
    )


class SqlOperationStore:
    def __init__(self, engine: Engine, fence: Fence | None = None) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence

    def load_operations(self) -> list[Operation]:
        with self._sessions() as session:
            return [_operation(row) for row in session.scalars(select(OperationRow))]

    def save_operation(self, op: Operation) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            row = session.get(OperationRow, op.id) or OperationRow(id=op.id)
            row.kind = op.kind.value
            row.state = op.state.value
            row.requested_by = op.requested_by[:128]
            row.reason = op.reason[:1024]
            row.idempotency_key = op.idempotency_key or None
            row.request_digest = op.request_digest
            row.cancel_requested = op.cancel_requested
            row.error = op.error[:2048]
            row.steps = [s.to_json() for s in op.steps]
            row.summary = dict(op.summary)
            row.created_at = _to_dt(op.created_at)  # type: ignore[assignment]
            row.updated_at = _to_dt(op.updated_at)  # type: ignore[assignment]
            session.merge(row)

    def delete_operations(self, op_ids: Sequence[str]) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            session.execute(delete(OperationRow).where(OperationRow.id.in_(list(op_ids))))


def _operation(row: OperationRow) -> Operation:
    return Operation(
        id=row.id,
        kind=OperationKind(row.kind),
        state=OperationState(row.state),
        requested_by=row.requested_by,
        reason=row.reason,
        created_at=_to_ts(row.created_at) or 0.0,
        updated_at=_to_ts(row.updated_at) or 0.0,
        steps=tuple(Step.from_json(s) for s in row.steps),
        idempotency_key=row.idempotency_key or "",
        request_digest=row.request_digest,
        cancel_requested=row.cancel_requested,
        error=row.error,
        summary=row.summary,
    )


class SqlEfficiencyStore:
    def __init__(self, engine: Engine, fence: Fence | None = None) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._fence = fence

    def add(self, sample: EfficiencySample) -> None:
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            session.add(
                EfficiencySampleRow(
                    taken_at=_to_dt(sample.taken_at),
                    efficiency=sample.efficiency,
                    current_goodput=sample.current_goodput,
                    best_goodput=sample.best_goodput,
                    plan_proposed=sample.plan_proposed,
                )
            )

    def prune_before(self, cutoff: float) -> int:
        """Delete the samples taken before ``cutoff`` (seconds since the epoch); return how
        many. One a planning pass (every 30 s by default): a year of them is a million rows
        that nothing reads, since the API shows the most recent ones."""
        with self._sessions.begin() as session:
            check_fence(session, self._fence)
            result = session.execute(
                delete(EfficiencySampleRow).where(EfficiencySampleRow.taken_at < _to_dt(cutoff))
            )
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    def recent(self, limit: int = 100) -> Sequence[EfficiencySample]:
        with self._sessions() as session:
            rows = session.scalars(
                select(EfficiencySampleRow)
                .order_by(EfficiencySampleRow.taken_at.desc())
                .limit(limit)
            ).all()
            return [
                EfficiencySample(
                    _to_ts(r.taken_at) or 0.0,
                    r.efficiency,
                    r.current_goodput,
                    r.best_goodput,
                    r.plan_proposed,
                )
                for r in reversed(rows)
            ]
