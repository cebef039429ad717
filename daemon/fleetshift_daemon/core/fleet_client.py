"""How the core talks to the fleet: a typed protocol, with domain types in and errors out.

The phase machine (``core.execution``) orders the actions of a move; this protocol is the
list of those actions, each one call to an agent or a worker. The gRPC adapter
(``fleetshift_daemon.clients.fleet``) implements it for real processes and an in-memory fake
(``tests/fakefleet.py``) for unit tests. A peer's refusal arrives as a FleetShift error whose
message is one sentence naming the peer; the few refusals the phase machine acts on have their
own types below, so a refusal that means something else can never be taken for one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fleetshift_common.errors import AlreadyExists, FailedPrecondition, NotFound
from fleetshift_common.vocabulary import Role
from fleetshift_daemon.core.perfmodel import Dtype


@dataclass(frozen=True)
class AgentRef:
    """A node's agent: its name (for messages) and where it listens."""

    node: str
    address: str


@dataclass(frozen=True)
class WorkerRef:
    """A worker process: its id (for messages) and its gRPC endpoint."""

    worker_id: str
    endpoint: str


@dataclass(frozen=True)
class WorkerLaunch:
    """What an agent needs to start a worker (``restore_snapshot_id``: a warm restore)."""

    worker_id: str
    model: str
    model_dir: str
    role: Role
    tp: int
    dtype: Dtype
    gpu_indices: tuple[int, ...]
    restore_snapshot_id: str = ""
    engine: str = "reference"
    engine_args_json: str = ""


@dataclass(frozen=True)
class ExportedSession:
    blob: bytes  # opaque to the daemon: the worker's own serialisation (safetensors)
    tokens: int  # prompt + generated when exported: the base of the next delta
    # Whether the blob carries KV. A vLLM worker's delta on the disk connector carries
    # tokens only (the destination computes the few after the pre-copied KV), so another
    # pre-copy round would not shorten the pause.
    kv_included: bool = True


class WorkerAlreadyRuns(AlreadyExists):
    """The agent already runs a worker with this id (a start retried)."""


class WorkerGone(NotFound):
    """The agent does not run this worker (any more): stopping it is already done."""


class SessionEnded(FailedPrecondition):
    """The worker holds no such session (it finished meanwhile): nothing left to carry."""


class FleetClient(Protocol):
    """Every call the daemon makes to agents and workers while it executes operations."""

    # -- agents ---------------------------------------------------------------------------
    async def start_worker(self, agent: AgentRef, launch: WorkerLaunch) -> str:
        """Start a worker; returns its endpoint once it serves. WorkerAlreadyRuns if so."""
        ...

    async def worker_endpoint(self, agent: AgentRef, worker_id: str) -> str:
        """The endpoint of a worker the agent runs; WorkerGone if it runs none by that id."""
        ...

    async def stop_worker(self, agent: AgentRef, worker_id: str) -> None:
        """Stop a worker; WorkerGone if the agent does not run it."""
        ...

    async def snapshot_worker(self, agent: AgentRef, worker_id: str, snapshot_id: str) -> int:
        """Snapshot a worker into the agent's store; returns the snapshot's size in bytes."""
        ...

    async def fetch_snapshot(self, agent: AgentRef, source: AgentRef, snapshot_id: str) -> None:
        """Have ``agent`` fetch a snapshot from ``source``'s store (chunked, resumable)."""
        ...

    # -- workers --------------------------------------------------------------------------
    async def pause(self, worker: WorkerRef) -> None: ...

    async def resume(self, worker: WorkerRef) -> None: ...

    async def session_ids(self, worker: WorkerRef) -> tuple[str, ...]:
        """The worker's live (unfinished) sessions."""
        ...

    async def live_sessions(self, worker: WorkerRef) -> int:
        """How many sessions the worker serves now (its counters)."""
        ...

    async def export_session(
        self, worker: WorkerRef, session_id: str, *, with_kv: bool, from_token: int = 0
    ) -> ExportedSession:
        """A copy of a session (the source keeps it); SessionEnded if it has finished."""
        ...

    async def import_session(
        self, worker: WorkerRef, blob: bytes, *, delta_for: str = "", staged: bool = False
    ) -> bool:
        """Start (or stage) a session on ``worker``; whether it restored the KV the blob
        carried (False: it recomputes the context from the session's token history)."""
        ...

    async def cancel_session(self, worker: WorkerRef, session_id: str) -> None: ...

    async def set_role(self, worker: WorkerRef, role: Role) -> int:
        """Change a worker's role in place; returns its role epoch after the change."""
        ...

    async def set_draining(self, worker: WorkerRef, draining: bool) -> None: ...

    async def close(self) -> None: ...
