"""An in-memory fleet behind the core's ``FleetClient`` protocol, with scripted failures.

It keeps what real agents and workers keep for a move (which workers run where, their sessions
live and staged, paused and draining flags, role epochs, snapshots per agent store) and answers
with the same domain errors the gRPC adapter raises, so the phase machine can be driven through
every phase and every crash point in milliseconds. ``fail(method)`` makes the next call (or the
n-th) of a method raise, as a peer that refused or went away would.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from fleetshift_common.errors import FailedPrecondition, FleetShiftError, Unavailable
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


@dataclass
class FakeWorker:
    worker_id: str
    node: str
    role: Role
    endpoint: str
    sessions: dict[str, int] = field(default_factory=dict)  # session -> tokens so far
    staged: dict[str, int] = field(default_factory=dict)
    paused: bool = False
    draining: bool = False
    role_epoch: int = 0
    restored_from: str = ""


@dataclass
class FakeFleet:
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    snapshots: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # node -> ids
    calls: list[str] = field(default_factory=list)
    _failures: dict[str, list[tuple[int, FleetShiftError]]] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _endings: dict[str, list[tuple[int, str, str]]] = field(default_factory=dict)

    # -- scripting ------------------------------------------------------------------------
    def run(self, worker_id: str, node: str, role: Role, sessions: dict[str, int]) -> FakeWorker:
        worker = FakeWorker(worker_id, node, role, f"fake://{worker_id}", dict(sessions))
        self.workers[worker_id] = worker
        return worker

    def fail(self, method: str, error: FleetShiftError | None = None, nth: int = 1) -> None:
        """The ``nth`` call of ``method`` from now raises ``error`` (a peer gone by default)."""
        err = error or Unavailable(f"{method}: the peer is unreachable (scripted)")
        due = self._counts[method] + nth
        self._failures.setdefault(method, []).append((due, err))

    def end_session(self, worker_id: str, session_id: str, before: str, nth: int = 1) -> None:
        """The session finishes on its worker just before the ``nth`` call of ``before``."""
        due = self._counts[before] + nth
        self._endings.setdefault(before, []).append((due, worker_id, session_id))

    def _call(self, method: str) -> None:
        self.calls.append(method)
        self._counts[method] += 1
        for due, worker_id, session_id in self._endings.get(method, []):
            if due == self._counts[method] and worker_id in self.workers:
                self.workers[worker_id].sessions.pop(session_id, None)
        for due, err in self._failures.get(method, []):
            if due == self._counts[method]:
                raise err

    def running(self) -> set[str]:
        return set(self.workers)

    def sessions_everywhere(self) -> list[str]:
        """Every live session on every running worker (a session twice shows twice)."""
        return sorted(s for w in self.workers.values() for s in w.sessions)

    def _worker(self, ref: WorkerRef) -> FakeWorker:
        worker = self.workers.get(ref.worker_id)
        if worker is None or worker.endpoint != ref.endpoint:
            raise Unavailable(f"worker {ref.worker_id!r}: nothing listens at {ref.endpoint}")
        return worker

    # -- agents ---------------------------------------------------------------------------
    async def start_worker(self, agent: AgentRef, launch: WorkerLaunch) -> str:
        self._call("start_worker")
        if launch.worker_id in self.workers:
            raise WorkerAlreadyRuns(f"agent of node {agent.node!r}: worker already runs")
        if (
            launch.restore_snapshot_id
            and launch.restore_snapshot_id not in self.snapshots[agent.node]
        ):
            raise FailedPrecondition(
                f"agent of node {agent.node!r}: no snapshot {launch.restore_snapshot_id!r}"
            )
        worker = self.run(launch.worker_id, agent.node, launch.role, {})
        worker.restored_from = launch.restore_snapshot_id
        return worker.endpoint

    async def worker_endpoint(self, agent: AgentRef, worker_id: str) -> str:
        self._call("worker_endpoint")
        worker = self.workers.get(worker_id)
        if worker is None or worker.node != agent.node:
            raise WorkerGone(f"agent of node {agent.node!r}: runs no worker {worker_id!r}")
        return worker.endpoint

    async def stop_worker(self, agent: AgentRef, worker_id: str) -> None:
        self._call("stop_worker")
        worker = self.workers.get(worker_id)
        if worker is None or worker.node != agent.node:
            raise WorkerGone(f"agent of node {agent.node!r}: runs no worker {worker_id!r}")
        del self.workers[worker_id]

    async def snapshot_worker(self, agent: AgentRef, worker_id: str, snapshot_id: str) -> int:
        self._call("snapshot_worker")
        if worker_id not in self.workers:
            raise FailedPrecondition(f"agent of node {agent.node!r}: no worker {worker_id!r}")
        self.snapshots[agent.node].add(snapshot_id)
        return 4096

    async def fetch_snapshot(self, agent: AgentRef, source: AgentRef, snapshot_id: str) -> None:
        self._call("fetch_snapshot")
        if snapshot_id not in self.snapshots[source.node]:
            raise FailedPrecondition(f"agent of node {source.node!r}: no snapshot")
        self.snapshots[agent.node].add(snapshot_id)

    # -- workers --------------------------------------------------------------------------
    async def pause(self, worker: WorkerRef) -> None:
        self._call("pause")
        self._worker(worker).paused = True

    async def resume(self, worker: WorkerRef) -> None:
        self._call("resume")
        self._worker(worker).paused = False

    async def session_ids(self, worker: WorkerRef) -> tuple[str, ...]:
        self._call("session_ids")
        return tuple(sorted(self._worker(worker).sessions))

    async def live_sessions(self, worker: WorkerRef) -> int:
        self._call("live_sessions")
        return len(self._worker(worker).sessions)

    async def export_session(
        self, worker: WorkerRef, session_id: str, *, with_kv: bool, from_token: int = 0
    ) -> ExportedSession:
        self._call("export_session")
        held = self._worker(worker)
        if session_id not in held.sessions:
            raise SessionEnded(f"worker {worker.worker_id!r}: no session {session_id!r}")
        tokens = held.sessions[session_id]
        blob = json.dumps({"session": session_id, "tokens": tokens, "kv": with_kv}).encode()
        return ExportedSession(blob, tokens, with_kv)

    async def import_session(
        self, worker: WorkerRef, blob: bytes, *, delta_for: str = "", staged: bool = False
    ) -> bool:
        self._call("import_session")
        held = self._worker(worker)
        data = json.loads(blob)
        session = delta_for or data["session"]
        if delta_for and delta_for not in held.staged:
            raise FailedPrecondition(f"worker {worker.worker_id!r}: no staged {delta_for!r}")
        held.staged.pop(session, None)
        (held.staged if staged else held.sessions)[session] = data["tokens"]
        return bool(data["kv"])

    async def cancel_session(self, worker: WorkerRef, session_id: str) -> None:
        self._call("cancel_session")
        held = self._worker(worker)
        held.sessions.pop(session_id, None)
        held.staged.pop(session_id, None)

    async def set_role(self, worker: WorkerRef, role: Role) -> int:
        self._call("set_role")
        held = self._worker(worker)
        held.role, held.role_epoch = role, held.role_epoch + 1
        return held.role_epoch

    async def set_draining(self, worker: WorkerRef, draining: bool) -> None:
        self._call("set_draining")
        self._worker(worker).draining = draining

    async def close(self) -> None:
        self.calls.append("close")
