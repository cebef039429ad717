"""Operations: every rebalance, drain and move, recorded from request to last step.

An operation is the unit of audit (who asked, why, the plan, each step's outcome and timings)
and the unit of recovery: each step carries the phase its state machine reached, written
before the action of the next phase starts, so a restarted daemon knows exactly what was done
and can finish or undo it. Idempotency keys make retries from a flaky client safe: the same
key with the same request returns the first operation; with a different request it is refused.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetshift_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from fleetshift_common.vocabulary import Role, StepPhase
from fleetshift_daemon.core.perfmodel import Dtype


class OperationKind(enum.Enum):
    REBALANCE = "rebalance"
    DRAIN = "drain"
    MOVE_WORKER = "move_worker"


class OperationState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # stopped; every step either completed or rolled back
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (OperationState.SUCCEEDED, OperationState.FAILED, OperationState.CANCELLED)


class StepKind(enum.Enum):
    ROLE_CHANGE = "role_change"  # in place
    MIGRATE = "migrate"  # same GPU model: snapshot, transfer, warm restore, sessions with KV
    COLD_START = "cold_start"  # other GPU model: fresh start, sessions as token history
    START = "start"  # a new worker where the plan wants one (no source)
    RETIRE = "retire"  # a surplus worker: drained of new work, stopped once its sessions end


class StepState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    SKIPPED = "skipped"  # cancelled before it started

    @property
    def finished(self) -> bool:
        return self in (StepState.DONE, StepState.ROLLED_BACK, StepState.SKIPPED)


@dataclass(frozen=True)
class Step:
    index: int
    kind: StepKind
    worker_id: str  # the source worker
    target_node: str
    target_role: Role | None = None
    target_gpus: tuple[int, ...] = ()
    phase: StepPhase = StepPhase.PLANNED  # the last one the phase machine completed
    state: StepState = StepState.PENDING
    new_worker_id: str = ""
    snapshot_id: str = ""
    bytes_moved: int = 0
    sessions_carried: int = 0
    max_session_pause_ms: float = 0.0
    snapshot_bytes: int = 0  # a warm move's snapshot (bytes_moved adds the sessions' blobs)
    model: str = ""  # START: what the new worker serves
    tp: int = 0
    dtype: Dtype | None = None
    predicted_gain: float = 0.0
    predicted_pause_s: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    error: str = ""
    # Of sessions_carried, those whose KV the target restored (the rest recomputed their
    # context from token history): the record of which path a move took, per step.
    sessions_kv_restored: int = 0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["kind"] = self.kind.value
        data["state"] = self.state.value
        data["phase"] = self.phase.value
        data["target_role"] = self.target_role.value if self.target_role else ""
        data["dtype"] = self.dtype.value if self.dtype else ""
        data["target_gpus"] = list(self.target_gpus)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Step:
        values = dict(data)
        values["kind"] = StepKind(values["kind"])
        values["state"] = StepState(values["state"])
        values["phase"] = StepPhase(values.get("phase") or StepPhase.PLANNED)
        values["target_role"] = Role(values["target_role"]) if values.get("target_role") else None
        values["dtype"] = Dtype(values["dtype"]) if values.get("dtype") else None
        values["target_gpus"] = tuple(values.get("target_gpus", ()))
        return cls(**values)


@dataclass(frozen=True)
class Operation:
    id: str
    kind: OperationKind
    state: OperationState
    requested_by: str
    reason: str
    created_at: float
    updated_at: float
    steps: tuple[Step, ...] = ()
    idempotency_key: str = ""
    request_digest: str = ""
    dry_run: bool = False
    cancel_requested: bool = False
    error: str = ""
    summary: Mapping[str, Any] = field(default_factory=dict)

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved for s in self.steps)

    @property
    def sessions_carried(self) -> int:
        return sum(s.sessions_carried for s in self.steps)


class OperationStore(Protocol):
    def load_operations(self) -> list[Operation]: ...

    def save_operation(self, op: Operation) -> None: ...

    def delete_operations(self, op_ids: Sequence[str]) -> None: ...


def request_digest(request: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()


# Ids per DELETE: well under SQLite's bound on a statement's parameters (32,766).
PRUNE_BATCH = 500


class OperationNotFound(NotFound):
    pass


class OperationLog:
    """All operations, in memory and in the store; the executor mutates them through here."""

    def __init__(self, store: OperationStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._ops: dict[str, Operation] = {}
        self._by_key: dict[str, str] = {}
        self._lock = threading.RLock()
        self._listeners: list[Callable[[Operation], None]] = []

    def load(self) -> None:
        with self._lock:
            self._ops = {op.id: op for op in self._store.load_operations()}
            self._by_key = {
                op.idempotency_key: op.id for op in self._ops.values() if op.idempotency_key
            }

    def refresh(self) -> list[Operation]:
        """A follower's catch-up with the store (the leader writes every change there):
        listeners hear of each operation that changed, as they would on the leader."""
        stored = self._store.load_operations()
        with self._lock:
            changed = [op for op in stored if self._ops.get(op.id) != op]
            for op in changed:
                self._ops[op.id] = op
                if op.idempotency_key:
                    self._by_key[op.idempotency_key] = op.id
            self._drop(set(self._ops) - {op.id for op in stored})  # pruned by the leader
        for op in changed:
            for listener in self._listeners:
                listener(op)
        return changed

    def on_change(self, listener: Callable[[Operation], None]) -> None:
        self._listeners.append(listener)

    def create(
        self,
        kind: OperationKind,
        requested_by: str,
        reason: str,
        steps: tuple[Step, ...],
        *,
        idempotency_key: str = "",
        request: Mapping[str, Any] | None = None,
        summary: Mapping[str, Any] | None = None,
    ) -> tuple[Operation, bool]:
        """Record a new operation; with a known key, return the first one (created=False)."""
        if len(idempotency_key) > 128:
            raise InvalidArgument(
                "idempotency_key is longer than 128 characters", field="idempotency_key"
            )
        digest = request_digest(request or {})
        with self._lock:
            existing_id = self._by_key.get(idempotency_key) if idempotency_key else None
            if existing_id is not None:
                existing = self._ops[existing_id]
                if existing.request_digest != digest:
                    raise AlreadyExists(
                        f"idempotency_key {idempotency_key!r} was already used for a different "
                        f"request (operation {existing.id})",
                        field="idempotency_key",
                    )
                return existing, False
            now = self._clock()
            op = Operation(
                id=f"op-{uuid.uuid4().hex[:12]}",
                kind=kind,
                state=OperationState.PENDING,
                requested_by=requested_by or "unknown",
                reason=reason,
                created_at=now,
                updated_at=now,
                steps=steps,
                idempotency_key=idempotency_key,
                request_digest=digest,
                summary=dict(summary or {}),
            )
            self._save(op)
            if idempotency_key:
                self._by_key[idempotency_key] = op.id
            return op, True

    def find_by_key(self, key: str, request: Mapping[str, Any]) -> Operation | None:
        """The operation a key already made, or None; a different request is refused."""
        with self._lock:
            op_id = self._by_key.get(key)
            if op_id is None:
                return None
            op = self._ops[op_id]
        if op.request_digest != request_digest(request):
            raise AlreadyExists(
                f"idempotency_key {key!r} was already used for a different request "
                f"(operation {op.id})",
                field="idempotency_key",
            )
        return op

    def get(self, op_id: str) -> Operation:
        if not op_id:
            raise InvalidArgument("operation_id must not be empty", field="operation_id")
        with self._lock:
            op = self._ops.get(op_id)
        if op is None:
            raise OperationNotFound(f"operation {op_id!r} does not exist", field="operation_id")
        return op

    def list(self, limit: int = 100, unfinished_only: bool = False) -> list[Operation]:
        ops = sorted(self._ops.values(), key=lambda o: o.created_at, reverse=True)
        if unfinished_only:
            ops = [o for o in ops if not o.state.finished]
        return ops[:limit]

    def update(self, op_id: str, **changes: Any) -> Operation:
        with self._lock:
            op = dataclasses.replace(self.get(op_id), updated_at=self._clock(), **changes)
            self._save(op)
            return op

    def update_step(self, op_id: str, index: int, **changes: Any) -> Operation:
        with self._lock:
            op = self.get(op_id)
            steps = list(op.steps)
            steps[index] = dataclasses.replace(steps[index], **changes)
            return self.update(op_id, steps=tuple(steps))

    def request_cancel(self, op_id: str) -> Operation:
        with self._lock:
            op = self.get(op_id)
            if op.state.finished:
                raise FailedPrecondition(
                    f"operation {op_id} already finished ({op.state.value})", field="operation_id"
                )
            return self.update(op_id, cancel_requested=True)

    def prune_finished(self, retention_s: float) -> Sequence[str]:
        """Delete the operations that finished more than ``retention_s`` ago; return their ids.

        Every planning pass that acts and every operator request leaves an operation behind;
        kept forever, the table, this process's copy of it and a follower's full re-read grow
        with the fleet's whole history. A finished operation is never touched again, so its
        ``updated_at`` (written by the clock of the leader that finished it, and kept in the
        database) is when it finished: unlike a worker's end, a restart does not reset it.
        Its idempotency key is honoured until then: the same key after the retention starts a
        new operation."""
        cutoff = self._clock() - retention_s
        with self._lock:
            due = sorted(
                op.id for op in self._ops.values() if op.state.finished and op.updated_at < cutoff
            )
            for first in range(0, len(due), PRUNE_BATCH):
                self._store.delete_operations(due[first : first + PRUNE_BATCH])
            self._drop(set(due))
        return due

    def _drop(self, op_ids: set[str]) -> None:
        for op_id in op_ids:
            op = self._ops.pop(op_id)
            if op.idempotency_key and self._by_key.get(op.idempotency_key) == op_id:
                del self._by_key[op.idempotency_key]

    def _save(self, op: Operation) -> None:
        self._store.save_operation(op)
        self._ops[op.id] = op
        for listener in self._listeners:
            listener(op)
