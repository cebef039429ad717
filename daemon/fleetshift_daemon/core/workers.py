"""Inference workers as the daemon tracks them: where each runs, what it serves, its sessions.

The agent is the authority on which worker processes exist on its node; the daemon is the
authority on what they are for. Agents report their workers with every heartbeat and the table
reconciles: a worker the daemon ordered shows up, a worker nobody ordered is adopted (an agent
restarted with workers still running, a daemon restored from an older database), and a worker
the agent no longer reports has failed. Workers that a move is creating or retiring are owned by
that operation and left to its executor, so a report racing a move never undoes it.

Live data (counters, session ids) stays in memory; what matters after a restart (identity,
placement, spec, state, origin) is written to the store before the view changes.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fleetshift_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from fleetshift_common.vocabulary import Role as Role
from fleetshift_common.vocabulary import WorkerState as WorkerState
from fleetshift_daemon.core.estimator import Completion
from fleetshift_daemon.core.fleet import WorkerCounters
from fleetshift_daemon.core.perfmodel import Dtype

WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# How many ended sessions the table remembers the last worker of (about 64 bytes each).
ENDED_SESSIONS_KEPT = 65_536


@dataclass(frozen=True)
class WorkerSpec:
    model: str
    role: Role
    tp: int = 1
    dtype: Dtype = Dtype.BF16

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("spec.model must not be empty", field="spec.model")
        if self.tp not in (1, 2, 4, 8):
            raise InvalidArgument(f"spec.tp must be 1, 2, 4 or 8, got {self.tp}", field="spec.tp")


@dataclass(frozen=True)
class WorkerRecord:
    id: str
    node: str
    spec: WorkerSpec
    gpu_indices: tuple[int, ...]
    endpoint: str
    state: WorkerState
    created_at: float
    origin_snapshot: str = ""
    operation_id: str = ""  # the move that owns this worker while it runs
    counters: WorkerCounters | None = field(default=None, compare=False)
    sessions: tuple[str, ...] = field(default=(), compare=False)
    # The worker's count of role changes behind spec.role (not persisted: after a daemon
    # restart the next report sets it).
    role_epoch: int = field(default=0, compare=False)


@dataclass(frozen=True)
class WorkerReport:
    """One worker as its agent sees it in a heartbeat."""

    worker_id: str
    spec: WorkerSpec
    gpu_indices: tuple[int, ...]
    endpoint: str
    state: WorkerState
    origin_snapshot: str = ""
    counters: WorkerCounters | None = None
    sessions: tuple[str, ...] = ()
    role_epoch: int = 0
    # Sessions that finished on the worker with no client reading them: it still holds their
    # tokens, and a client coming back must be sent there (see locate_session).
    unread: tuple[str, ...] = ()
    # Sessions that finished there lately by their own end, for the output-length estimator
    # (repeated in every heartbeat; see core.estimator.CompletionLedger).
    finished: tuple[Completion, ...] = ()


class WorkerStore(Protocol):
    def load_workers(self) -> list[WorkerRecord]: ...

    def save_worker(self, worker: WorkerRecord) -> None: ...

    def delete_worker(self, worker_id: str) -> None: ...


class WorkerNotFound(NotFound):
    pass


def check_worker_id(worker_id: str, field_name: str = "worker_id") -> None:
    if not WORKER_ID.match(worker_id or ""):
        raise InvalidArgument(
            f"{field_name} {worker_id!r} must be 1-63 letters, digits, '.', '_' or '-'",
            field=field_name,
        )


class WorkerTable:
    def __init__(self, store: WorkerStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        self._by_node: dict[str, set[str]] = {}  # heartbeats reconcile one node in O(its workers)
        self._lock = threading.RLock()
        self._listeners: list[Callable[[], None]] = []
        # session id -> the worker that last listed it. A session can end on a worker while
        # its client is away (a move's target finishes it before the client re-attaches);
        # the worker still holds its tokens, and the client must be told where to read them.
        # Kept in memory only: a restarted daemon relearns it from the workers' reports of
        # their unread sessions (WorkerReport.unread).
        self._last_worker_of: OrderedDict[str, str] = OrderedDict()
        # Workers this process adopted from a report: their created_at is when we first saw
        # them, not when they started, so their counters may hold hours of history.
        self._adopted: set[str] = set()
        # Ended (stopped or failed) workers -> when this process first saw them ended, for
        # prune_ended; and who hears of workers leaving the table (the monitors' per-worker
        # state goes with them).
        self._ended_at: dict[str, float] = {}
        self._forget: list[Callable[[str], None]] = []

    def load(self) -> None:
        stored = self._store.load_workers()
        with self._lock:
            self._replace_all(stored)
        self._changed()

    def _replace_all(self, workers: Iterable[WorkerRecord]) -> None:
        """Swap in a whole new table at once. Readers (Route's index rebuild on the event
        loop) take no lock: filling the live dict in place let one read it half-filled, or
        empty, while a follower's refresh ran in its thread."""
        table: dict[str, WorkerRecord] = {}
        by_node: dict[str, set[str]] = {}
        for worker in workers:
            table[worker.id] = worker
            by_node.setdefault(worker.node, set()).add(worker.id)
            self._note_ended(worker)
        gone = [worker_id for worker_id in self._workers if worker_id not in table]
        self._workers, self._by_node = table, by_node
        self._forget_all(gone)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Called after every change of the table (the router rebuilds its index from it)."""
        self._listeners.append(listener)

    def on_forget(self, listener: Callable[[str], None]) -> None:
        """Called with a worker's id once its record left the table (pruned here, or gone
        from the store at a follower's refresh): per-worker state kept elsewhere (the
        traffic and SLO monitors' last counters and samples) must go with it, or it grows
        with every worker the fleet ever ran."""
        self._forget.append(listener)

    def _forget_all(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            self._ended_at.pop(worker_id, None)
            self._adopted.discard(worker_id)
            for listener in self._forget:
                listener(worker_id)

    def _note_ended(self, worker: WorkerRecord) -> None:
        if worker.state.alive:
            self._ended_at.pop(worker.id, None)
        else:
            self._ended_at.setdefault(worker.id, self._clock())

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def _put(self, worker: WorkerRecord) -> None:
        old = self._workers.get(worker.id)
        if old is not None and old.node != worker.node:
            self._by_node.get(old.node, set()).discard(worker.id)
        if old is not None and old.sessions != worker.sessions:
            self._remember_ended(worker.id, set(old.sessions).difference(worker.sessions))
        self._workers[worker.id] = worker
        self._by_node.setdefault(worker.node, set()).add(worker.id)
        self._note_ended(worker)

    def get(self, worker_id: str) -> WorkerRecord:
        check_worker_id(worker_id)
        with self._lock:
            worker = self._workers.get(worker_id)
        if worker is None:
            raise WorkerNotFound(f"worker {worker_id!r} is not known", field="worker_id")
        return worker

    def find(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def all(self, node: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return sorted(
            (
                w
                for w in list(self._workers.values())  # a copy: writers run in other threads
                if (node is None or w.node == node) and (model is None or w.spec.model == model)
            ),
            key=lambda w: w.id,
        )

    def alive(self) -> list[WorkerRecord]:
        return [w for w in self.all() if w.state.alive]

    def add(self, worker: WorkerRecord) -> WorkerRecord:
        check_worker_id(worker.id)
        with self._lock:
            if worker.id in self._workers and self._workers[worker.id].state.alive:
                raise AlreadyExists(f"worker {worker.id!r} already exists", field="worker_id")
            self._store.save_worker(worker)
            self._put(worker)
        self._changed()
        return worker

    def update(self, worker_id: str, **changes: object) -> WorkerRecord:
        with self._lock:
            worker = dataclasses.replace(self.get(worker_id), **changes)  # type: ignore[arg-type]
            self._store.save_worker(worker)
            self._put(worker)
        self._changed()
        return worker

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._store.delete_worker(worker_id)
            self._drop(worker_id)
        self._changed()

    def _drop(self, worker_id: str) -> None:
        gone = self._workers.pop(worker_id, None)
        if gone is not None:
            self._by_node.get(gone.node, set()).discard(worker_id)
        self._forget_all((worker_id,))

    def prune_ended(self, retention_s: float) -> list[str]:
        """Delete the records of workers that ended (stopped or failed) at least
        ``retention_s`` ago, and return their ids.

        Every move and retirement leaves its source behind as a STOPPED record; kept forever,
        they would make every heartbeat's reconcile, Route's index rebuild and a follower's
        refresh walk the whole history of the fleet, and the monitors keep state per worker
        id. An ended worker stays long enough for an operator to look at it and for a client
        whose session ended there to be told so; one an operation still owns is never
        pruned. The time it ended is the time this process saw it ended: after a restart the
        retention counts again from the load, so nothing is pruned early."""
        now = self._clock()
        with self._lock:
            due = [
                worker_id
                for worker_id, ended_at in self._ended_at.items()
                if now - ended_at >= retention_s
                and (worker := self._workers.get(worker_id)) is not None
                and not worker.state.alive
                and not worker.operation_id
            ]
            for worker_id in due:
                self._store.delete_worker(worker_id)
                self._drop(worker_id)
        if due:
            self._changed()
        return due

    def gpus_in_use(self, node: str) -> set[int]:
        with self._lock:
            on_node = [self._workers[i] for i in self._by_node.get(node, ())]
        return {i for w in on_node if w.state.alive for i in w.gpu_indices}

    def reconcile(self, node: str, reports: Sequence[WorkerReport]) -> list[str]:
        """Apply one heartbeat's worker list; returns ids of workers that turned FAILED."""
        failed: list[str] = []
        durable_change = False
        with self._lock:
            seen = {r.worker_id for r in reports}
            for report in reports:
                durable_change |= self._apply_report(node, report)
            for worker_id in list(self._by_node.get(node, ())):
                worker = self._workers[worker_id]
                vanished = worker.id not in seen
                if vanished and worker.state.alive and not worker.operation_id:
                    failed_worker = dataclasses.replace(worker, state=WorkerState.FAILED)
                    self._store.save_worker(failed_worker)
                    self._put(failed_worker)
                    failed.append(worker.id)
        if durable_change or failed:
            self._changed()
        return failed

    def observe(self, node: str, reports: Sequence[WorkerReport]) -> None:
        """A follower's share of a heartbeat: the live fields (counters, sessions, role epoch)
        of workers it already knows, in memory only. Adopting, failing and every other durable
        change is the leader's (it gets the same heartbeat); the view catches up on refresh."""
        with self._lock:
            for report in reports:
                known = self._workers.get(report.worker_id)
                if known is None or known.node != node:
                    continue
                self._remember_ended(known.id, report.unread)
                newer = report.role_epoch >= known.role_epoch
                self._put(
                    dataclasses.replace(
                        known,
                        counters=report.counters,
                        sessions=known.sessions if known.operation_id else report.sessions,
                        role_epoch=report.role_epoch if newer else known.role_epoch,
                    )
                )

    def refresh(self) -> bool:
        """Bring the durable records in step with the store, keeping the live fields the
        heartbeats gave; listeners hear of it only when a durable field changed."""
        stored = self._store.load_workers()
        with self._lock:
            old = self._workers
            fresh: dict[str, WorkerRecord] = {}
            for worker in stored:
                mine = old.get(worker.id)
                if mine is not None:
                    worker = dataclasses.replace(
                        worker,
                        counters=mine.counters,
                        sessions=mine.sessions,
                        role_epoch=mine.role_epoch,
                    )
                fresh[worker.id] = worker
            changed = fresh != old
            if changed:
                self._replace_all(fresh.values())
        if changed:
            self._changed()
        return changed

    def _apply_report(self, node: str, report: WorkerReport) -> bool:
        known = self._workers.get(report.worker_id)
        if known is None:
            adopted = WorkerRecord(
                id=report.worker_id,
                node=node,
                spec=report.spec,
                gpu_indices=report.gpu_indices,
                endpoint=report.endpoint,
                state=report.state,
                created_at=self._clock(),
                origin_snapshot=report.origin_snapshot,
                counters=report.counters,
                sessions=report.sessions,
                role_epoch=report.role_epoch,
            )
            self._store.save_worker(adopted)
            self._put(adopted)
            self._remember_ended(adopted.id, report.unread)
            self._adopted.add(adopted.id)
            return True
        if known.node != node:
            raise FailedPrecondition(
                f"worker {report.worker_id!r} belongs to node {known.node!r}, not {node!r}",
                field="workers.worker_id",
            )
        spec, role_epoch = report.spec, report.role_epoch
        if role_epoch < known.role_epoch:
            # Polled before the role change the executor has already recorded: keep that role.
            spec, role_epoch = dataclasses.replace(spec, role=known.spec.role), known.role_epoch
        durable = (
            known.endpoint != report.endpoint
            or known.spec != spec
            or (known.state != report.state and not known.operation_id)
        )
        updated = dataclasses.replace(
            known,
            endpoint=report.endpoint,
            spec=spec,
            role_epoch=role_epoch,
            state=known.state if known.operation_id else report.state,
            counters=report.counters,
            # A moving worker's sessions are the executor's to say: a report polled before the
            # switch must not put moved sessions back on the source.
            sessions=known.sessions if known.operation_id else report.sessions,
        )
        if durable:
            self._store.save_worker(updated)
        self._put(updated)
        self._remember_ended(updated.id, report.unread)
        return durable

    def born_at(self, worker: WorkerRecord) -> float | None:
        """When the worker started, if this daemon knows it (it created the worker)."""
        return None if worker.id in self._adopted else worker.created_at

    def _remember_ended(self, worker_id: str, session_ids: Iterable[str]) -> None:
        trail = self._last_worker_of
        for session_id in session_ids:
            trail[session_id] = worker_id
            trail.move_to_end(session_id)
        while len(trail) > ENDED_SESSIONS_KEPT:
            trail.popitem(last=False)

    def locate_session(self, session_id: str) -> WorkerRecord | None:
        """The live worker that lists the session; else the live worker that listed it last.

        A session that ended (or moved on, or was dropped) leaves the last worker to list it
        on record: a session that finished on a move's target before its client re-attached
        is still readable there, and a client told NOT_FOUND would wait in vain. A worker
        also reports the sessions it finished that no client has read, so the record is
        rebuilt by a restarted daemon (and a follower) from the next heartbeats."""
        workers = list(self._workers.values())  # a copy: writers run in other threads
        for worker in workers:
            if worker.state.alive and session_id in worker.sessions:
                return worker
        last = self._workers.get(self._last_worker_of.get(session_id, ""))
        return last if last is not None and last.state.alive else None
