"""Executes operations: each step a persisted state machine, make-before-break.

A move of a worker runs through phases, and each phase is written to the operation log before
the next action starts:

    planned -> target_reserved -> [snapshot_taken -> snapshot_fetched] -> target_started
            -> source_paused -> sessions_copied -> switched -> source_retired -> done

(the bracketed phases only for a warm migrate to the same GPU model). A retirement of a surplus
worker is ``planned -> draining -> switched -> source_retired -> done``: the router stops
sending it sessions and the worker refuses new ones, the executor waits until it has none, and
only then stops it; sessions still live at the drain deadline roll the step back and the worker
takes sessions again. Until ``switched`` the
source worker serves, or holds its sessions paused; a failure anywhere before it rolls back:
the target is stopped, the source resumed, nothing lost. From ``switched`` on the target owns
every session and the step is completed forward whatever happens. A daemon that restarts
applies the same rule to the phase it finds in the log, so every session has exactly one
worker, and the operation records which way it went.

Sessions move in two stages on a warm migrate: each is copied with its KV to the target as a
held copy while the source keeps decoding, then the source pauses at a step boundary and only
the small deltas (new tokens, sampling state, the last KV blocks) follow, so the pause does not
grow with the context (Llumnix). A cold start carries the token history instead, recomputed at
the target. Either way the target continues generating at once and the source cancels its
copies only after the switch, so its clients' streams end with ABORTED "moved" and they
re-attach through ``LocateSession`` at the token they reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift_common.errors import (
    FailedPrecondition,
    FleetShiftError,
)
from fleetshift_common.failpoints import Failpoints
from fleetshift_daemon.api import convert
from fleetshift_daemon.core.operations import (
    Operation,
    OperationLog,
    OperationState,
    Step,
    StepKind,
    StepState,
)
from fleetshift_daemon.core.perfmodel import Dtype
from fleetshift_daemon.core.placement import PlacementService
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec, WorkerState, WorkerTable
from fleetshift_rpc.errors import peer_error
from fleetshift_rpc.metrics import DaemonMetrics
from fleetshift_rpc.server import channel

log = logging.getLogger("fleetshift.daemon.executor")

PHASES = (
    "planned",
    "draining",  # a retirement: no new sessions, waiting for the live ones to end
    "target_reserved",
    "snapshot_taken",
    "snapshot_fetched",
    "target_started",
    "source_paused",
    "sessions_copied",
    "switched",
    "source_retired",
    "done",
)
SWITCHED = PHASES.index("switched")
RPC_TIMEOUT_S = 30.0
START_TIMEOUT_S = 600.0
PRECOPY_ROUNDS = 8
DRAIN_SETTLE_S = 2.0  # a retiring worker must stay idle this long before it is stopped


class StepFailed(Exception):
    pass


@dataclass
class Clients:
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

    def agent(self, address: str) -> agent_pb2_grpc.AgentServiceStub:
        return agent_pb2_grpc.AgentServiceStub(self._channel(address))

    def worker(self, endpoint: str) -> worker_pb2_grpc.WorkerServiceStub:
        return worker_pb2_grpc.WorkerServiceStub(self._channel(endpoint, self.session_blob_bytes))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class Executor:
    def __init__(
        self,
        ops: OperationLog,
        registry: Registry,
        workers: WorkerTable,
        placement: PlacementService,
        clients: Clients,
        metrics: DaemonMetrics | None = None,
        clock: Callable[[], float] = time.time,
        failpoints: Failpoints | None = None,
        drain_timeout_s: float = 600.0,
    ) -> None:
        self._drain_timeout_s = drain_timeout_s
        self._ops = ops
        self._registry = registry
        self._workers = workers
        self._placement = placement
        self._clients = clients
        self._metrics = metrics
        self._clock = clock
        self._failpoints = failpoints or Failpoints()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def submit(self, op: Operation, recovering: bool = False) -> None:
        if op.id in self._tasks and not self._tasks[op.id].done():
            return
        self._tasks[op.id] = asyncio.create_task(
            self._run(op.id, recovering), name=f"operation {op.id}"
        )

    def recover(self) -> list[str]:
        """Resume every operation a previous daemon process left unfinished."""
        resumed = []
        for op in self._ops.list(limit=10_000, unfinished_only=True):
            log.warning("resuming operation after a restart", extra={"operation": op.id})
            self.submit(op, recovering=True)
            resumed.append(op.id)
        return resumed

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self._clients.close()

    def running(self) -> list[Operation]:
        return [self._ops.get(i) for i, t in self._tasks.items() if not t.done()]

    # -- single workers (the scheduler's and operators' StartWorker / StopWorker) ---------------
    async def start_worker(
        self, spec: WorkerSpec, node: str, gpus: tuple[int, ...], owner: str = "start"
    ) -> WorkerRecord:
        served = self._placement.models.get(spec.model)
        record = WorkerRecord(
            id=f"w-{uuid.uuid4().hex[:10]}",
            node=node,
            spec=spec,
            gpu_indices=gpus,
            endpoint="",
            state=WorkerState.STARTING,
            created_at=self._clock(),
            operation_id=owner,  # owned: a heartbeat racing the start must not fail it
        )
        await asyncio.to_thread(self._workers.add, record)
        agent = self._clients.agent(self._registry.get(node).agent_address)
        try:
            status = await agent.StartWorker(
                agent_pb2.StartWorkerRequest(
                    worker_id=record.id,
                    model=spec.model,
                    model_dir=served.model_dir if served else "",
                    role=convert.ROLE_TO_PB[spec.role],
                    tensor_parallel=spec.tp,
                    dtype=spec.dtype.value,
                    gpu_indices=list(gpus),
                ),
                timeout=START_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as err:
            await asyncio.to_thread(self._workers.remove, record.id)
            raise agent_error(err, node) from None
        return await asyncio.to_thread(
            self._workers.update,
            record.id,
            endpoint=status.endpoint,
            state=WorkerState.SERVING,
            operation_id="",
        )

    async def stop_worker(self, worker_id: str) -> WorkerRecord:
        worker = self._workers.get(worker_id)
        if worker.operation_id:
            raise FailedPrecondition(
                f"worker {worker_id!r} is being moved by operation {worker.operation_id}",
                field="worker_id",
            )
        await self._stop_worker(worker, deadline_s=30.0)
        return await asyncio.to_thread(
            self._workers.update, worker_id, state=WorkerState.STOPPED, sessions=()
        )

    # -- the operation -----------------------------------------------------------------------
    async def _run(self, op_id: str, recovering: bool = False) -> None:
        started = self._clock()
        op = await self._save(op_id, state=OperationState.RUNNING)
        failed = await self._recover_step(op) if recovering else ""
        for step in self._ops.get(op_id).steps:
            if step.state.finished:
                continue
            op = self._ops.get(op_id)
            if op.cancel_requested and step.state is StepState.PENDING:
                await self._save_step(op_id, step.index, state=StepState.SKIPPED)
                continue
            if failed:
                await self._save_step(
                    op_id, step.index, state=StepState.SKIPPED, error="an earlier step failed"
                )
                continue
            try:
                await self._run_step(op_id, step.index)
            except Exception as err:  # every failure becomes a rolled-back step, never a crash
                failed = f"step {step.index} ({step.kind.value} of {step.worker_id}): {err}"
                log.error("step failed: %s", failed, extra={"operation": op_id})
        op = self._ops.get(op_id)
        if failed:
            state = OperationState.FAILED
        elif op.cancel_requested and any(s.state is StepState.SKIPPED for s in op.steps):
            state = OperationState.CANCELLED
        else:
            state = OperationState.SUCCEEDED
        op = await self._save(op_id, state=state, error=failed)
        if self._metrics is not None:
            self._metrics.operation_finished(op.kind.value, state.value, self._clock() - started)
        log.info("operation finished", extra={"operation": op_id, "state": state.value})

    async def _recover_step(self, op: Operation) -> str:
        """The step a dead daemon was in: forward from the switch on, else rolled back (and the
        operation stops there: what was planned before the restart may no longer hold)."""
        for step in op.steps:
            if step.state is not StepState.RUNNING:
                continue
            if PHASES.index(step.phase) >= SWITCHED:
                await self._finish_forward(op.id, step)
                return ""
            why = f"the daemon restarted during step {step.index} at phase {step.phase!r}"
            await self._rollback(op.id, step, why)
            return why + "; rolled back"
        return ""

    async def _run_step(self, op_id: str, index: int) -> None:
        step = self._ops.get(op_id).steps[index]
        if step.state is StepState.PENDING:
            step = await self._save_step(
                op_id, index, state=StepState.RUNNING, started_at=self._clock()
            )
        try:
            if step.kind is StepKind.ROLE_CHANGE:
                await self._role_change(op_id, step)
            elif step.kind is StepKind.START:
                await self._start_step(op_id, step)
            elif step.kind is StepKind.RETIRE:
                await self._retire(op_id, step)
            else:
                await self._move(op_id, step)
        except Exception as err:
            step = self._ops.get(op_id).steps[index]
            if PHASES.index(step.phase) >= SWITCHED:
                await self._finish_forward(op_id, step)  # the target owns the sessions now
                return
            await self._rollback(op_id, step, str(err))
            raise

    async def _role_change(self, op_id: str, step: Step) -> None:
        worker = self._workers.get(step.worker_id)
        role = Role(step.target_role)
        stub = self._clients.worker(worker.endpoint)
        info = await stub.SetRole(
            worker_pb2.SetWorkerRoleRequest(role=convert.ROLE_TO_PB[role]), timeout=RPC_TIMEOUT_S
        )
        await asyncio.to_thread(
            self._workers.update,
            worker.id,
            spec=_with_role(worker, role),
            role_epoch=info.role_epoch,  # a heartbeat polled before the change must not undo it
        )
        await self._save_step(
            op_id, step.index, phase="done", state=StepState.DONE, finished_at=self._clock()
        )

    async def _start_step(self, op_id: str, step: Step) -> None:
        spec = WorkerSpec(step.model, Role(step.target_role), step.tp, Dtype(step.dtype or "bf16"))
        worker = await self.start_worker(spec, step.target_node, step.target_gpus, owner=op_id)
        await self._save_step(
            op_id,
            step.index,
            phase="done",
            state=StepState.DONE,
            new_worker_id=worker.id,
            finished_at=self._clock(),
        )

    async def _retire(self, op_id: str, step: Step) -> None:
        """Drain, then stop: the worker takes no new session and is stopped once it has none."""
        worker = self._workers.get(step.worker_id)
        if _before(step, "draining"):
            if worker.state is not WorkerState.SERVING or worker.operation_id:
                raise FailedPrecondition(
                    f"worker {worker.id!r} is {worker.state.value}, not serving and free",
                    field="worker_id",
                )
            await asyncio.to_thread(
                self._workers.update, worker.id, state=WorkerState.DRAINING, operation_id=op_id
            )
            step = await self._phase(op_id, step, "draining")
        if _before(step, "switched"):
            await self._clients.worker(worker.endpoint).SetDraining(
                worker_pb2.SetWorkerDrainingRequest(draining=True), timeout=RPC_TIMEOUT_S
            )
            await self._wait_drained(op_id, worker)
            step = await self._phase(op_id, step, "switched")
        await self._finish_forward(op_id, step)

    async def _wait_drained(self, op_id: str, worker: WorkerRecord) -> None:
        """Until the worker, which now refuses new sessions, has served none for DRAIN_SETTLE_S:
        a session opened just before it was told to drain may still be starting."""
        stub = self._clients.worker(worker.endpoint)
        give_up = time.monotonic() + self._drain_timeout_s
        idle_since: float | None = None
        while True:
            counters = await stub.GetCounters(
                worker_pb2.GetWorkerCountersRequest(), timeout=RPC_TIMEOUT_S
            )
            now = time.monotonic()
            if counters.live_sessions:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            if idle_since is not None and now - idle_since >= DRAIN_SETTLE_S:
                return
            if self._ops.get(op_id).cancel_requested:
                raise FailedPrecondition("cancelled while draining", field="operation")
            if time.monotonic() > give_up:
                raise FailedPrecondition(
                    f"worker {worker.id!r} still serves {counters.live_sessions} sessions after "
                    f"{self._drain_timeout_s:.0f} s of draining; it serves on",
                    field="worker_id",
                )
            await asyncio.sleep(0.5)

    # -- a move, phase by phase ---------------------------------------------------------------
    async def _move(self, op_id: str, step: Step) -> None:
        source = self._workers.get(step.worker_id)
        warm = step.kind is StepKind.MIGRATE
        if _before(step, "target_reserved"):
            step = await self._reserve(op_id, step, source)
        if warm and _before(step, "snapshot_taken"):
            step = await self._snapshot(op_id, step, source)
        if warm and _before(step, "snapshot_fetched"):
            step = await self._fetch(op_id, step, source)
        if _before(step, "target_started"):
            step = await self._start_target(op_id, step, source, warm)
        if _before(step, "sessions_copied"):
            step = await self._copy_sessions(op_id, step, source, warm)
        if _before(step, "switched"):
            step = await self._switch(op_id, step, source)
        await self._finish_forward(op_id, step)

    async def _reserve(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        new_id = f"w-{uuid.uuid4().hex[:10]}"
        await asyncio.to_thread(
            self._workers.update, source.id, state=WorkerState.DRAINING, operation_id=op_id
        )
        target = WorkerRecord(
            id=new_id,
            node=step.target_node,
            spec=_with_role(source, Role(step.target_role)),
            gpu_indices=step.target_gpus,
            endpoint="",
            state=WorkerState.STARTING,
            created_at=self._clock(),
            operation_id=op_id,
        )
        await asyncio.to_thread(self._workers.add, target)
        return await self._phase(op_id, step, "target_reserved", new_worker_id=new_id)

    async def _snapshot(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        snapshot_id = f"{op_id}-{step.index}"
        agent = self._clients.agent(self._registry.get(source.node).agent_address)
        reply = await agent.SnapshotWorker(
            agent_pb2.SnapshotWorkerRequest(worker_id=source.id, snapshot_id=snapshot_id),
            timeout=START_TIMEOUT_S,
        )
        return await self._phase(
            op_id, step, "snapshot_taken", snapshot_id=snapshot_id, bytes_moved=reply.size_bytes
        )

    async def _fetch(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        target_agent = self._clients.agent(self._registry.get(step.target_node).agent_address)
        source_address = self._registry.get(source.node).agent_address
        await target_agent.FetchSnapshot(
            agent_pb2.FetchSnapshotRequest(
                source_agent_address=source_address, snapshot_id=step.snapshot_id
            ),
            timeout=START_TIMEOUT_S,
        )
        return await self._phase(op_id, step, "snapshot_fetched")

    async def _start_target(self, op_id: str, step: Step, source: WorkerRecord, warm: bool) -> Step:
        served = self._placement.models.get(source.spec.model)
        target_agent = self._clients.agent(self._registry.get(step.target_node).agent_address)
        role = Role(step.target_role)
        request = agent_pb2.StartWorkerRequest(
            worker_id=step.new_worker_id,
            model=source.spec.model,
            model_dir=served.model_dir if served else "",
            role=convert.ROLE_TO_PB[role],
            tensor_parallel=source.spec.tp,
            dtype=source.spec.dtype.value,
            gpu_indices=list(step.target_gpus),
            restore_snapshot_id=step.snapshot_id if warm else "",
        )
        try:
            status = await target_agent.StartWorker(request, timeout=START_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:  # a retry after a daemon restart
                raise
            info = await target_agent.GetAgentInfo(
                agent_pb2.GetAgentInfoRequest(), timeout=RPC_TIMEOUT_S
            )
            status = next(w for w in info.workers if w.worker_id == step.new_worker_id)
        await asyncio.to_thread(self._workers.update, step.new_worker_id, endpoint=status.endpoint)
        return await self._phase(op_id, step, "target_started")

    async def _copy_sessions(
        self, op_id: str, step: Step, source: WorkerRecord, warm: bool
    ) -> Step:
        """Pre-copy while the source decodes (warm moves), then pause it only for the deltas.

        The source keeps every session until the switch (nothing is released here), so a
        failure before it still rolls back to a source that lost nothing."""
        src = self._clients.worker(source.endpoint)
        dst = self._clients.worker(self._workers.get(step.new_worker_id).endpoint)
        bases: dict[str, int] = {}
        moved_bytes = 0
        if warm:  # a cold target recomputes the context anyway: pre-copy would not shorten it
            bases, moved_bytes = await self._precopy(src, dst)
        paused_at = time.monotonic()
        await src.Pause(worker_pb2.WorkerPauseRequest(), timeout=RPC_TIMEOUT_S)
        step = await self._phase(op_id, step, "source_paused")
        info = await src.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
        moved = []
        for session_id in info.session_ids:
            base = bases.get(session_id)
            request = worker_pb2.ExportSessionRequest(
                session_id=session_id, with_kv=warm, release=False, from_token=base or 0
            )
            try:
                exported = await src.ExportSession(request, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                continue  # finished meanwhile: nothing to carry (its held copy dies with it)
            final = worker_pb2.ImportSessionRequest(blob=exported.blob)
            if base is not None:
                final.delta_for = session_id
            await dst.ImportSession(final, timeout=RPC_TIMEOUT_S)
            moved.append(session_id)
            moved_bytes += len(exported.blob)
        pause_ms = (time.monotonic() - paused_at) * 1000
        await asyncio.to_thread(self._workers.update, step.new_worker_id, sessions=tuple(moved))
        return await self._phase(
            op_id,
            step,
            "sessions_copied",
            sessions_carried=len(moved),
            bytes_moved=step.bytes_moved + moved_bytes,
            max_session_pause_ms=pause_ms,
        )

    async def _precopy(
        self, src: worker_pb2_grpc.WorkerServiceStub, dst: worker_pb2_grpc.WorkerServiceStub
    ) -> tuple[dict[str, int], int]:
        """Copy each live session with its KV to the target as a held (staged) copy, then
        catch up in rounds until a round finds at most one new token (Llumnix-style)."""
        info = await src.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
        bases: dict[str, int] = {}
        copied = 0
        for session_id in info.session_ids:
            try:
                pre = await src.ExportSession(
                    worker_pb2.ExportSessionRequest(session_id=session_id, with_kv=True),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                continue
            await dst.ImportSession(
                worker_pb2.ImportSessionRequest(blob=pre.blob, staged=True), timeout=RPC_TIMEOUT_S
            )
            bases[session_id] = pre.tokens
            copied += len(pre.blob)
        for session_id in list(bases):
            for _ in range(PRECOPY_ROUNDS):
                try:
                    more = await src.ExportSession(
                        worker_pb2.ExportSessionRequest(
                            session_id=session_id, with_kv=True, from_token=bases[session_id]
                        ),
                        timeout=RPC_TIMEOUT_S,
                    )
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    await dst.CancelSession(
                        worker_pb2.CancelSessionRequest(session_id=session_id),
                        timeout=RPC_TIMEOUT_S,
                    )
                    del bases[session_id]
                    break
                await dst.ImportSession(
                    worker_pb2.ImportSessionRequest(
                        blob=more.blob, delta_for=session_id, staged=True
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
                grew, bases[session_id] = more.tokens - bases[session_id], more.tokens
                copied += len(more.blob)
                if grew <= 1:
                    break
        return bases, copied

    async def _switch(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        target = self._workers.get(step.new_worker_id)
        await asyncio.to_thread(
            self._workers.update, target.id, state=WorkerState.SERVING, operation_id=""
        )
        await asyncio.to_thread(
            self._workers.update, source.id, state=WorkerState.DRAINING, sessions=()
        )
        return await self._phase(op_id, step, "switched")

    async def _finish_forward(self, op_id: str, step: Step) -> None:
        """From the switch on: end the source's copies of the sessions, retire it, done."""
        source = self._workers.find(step.worker_id)
        if source is not None and source.state.alive and _before(step, "source_retired"):
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._cancel_all(source)
            await self._stop_worker(source)
            await asyncio.to_thread(
                self._workers.update,
                source.id,
                state=WorkerState.STOPPED,
                operation_id="",
                sessions=(),
            )
            step = await self._phase(op_id, step, "source_retired")
        target = self._workers.find(step.new_worker_id)
        if target is not None and target.operation_id:
            await asyncio.to_thread(
                self._workers.update, target.id, state=WorkerState.SERVING, operation_id=""
            )
        await self._save_step(
            op_id, step.index, phase="done", state=StepState.DONE, finished_at=self._clock()
        )
        if self._metrics is not None:
            done = self._ops.get(op_id).steps[step.index]
            self._metrics.step_moved(done.kind.value, done.bytes_moved, done.sessions_carried)

    async def _cancel_all(self, source: WorkerRecord) -> None:
        src = self._clients.worker(source.endpoint)
        info = await src.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
        for session_id in getattr(info, "session_ids", ()):
            with contextlib.suppress(grpc.aio.AioRpcError):
                await src.CancelSession(
                    worker_pb2.CancelSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S
                )

    # -- undo ---------------------------------------------------------------------------------
    async def _rollback(self, op_id: str, step: Step, why: str) -> None:
        log.warning("rolling back step %d: %s", step.index, why, extra={"operation": op_id})
        if step.kind is StepKind.START:  # a start cut short: stop what it may have started
            for worker in self._workers.all(node=step.target_node):
                if worker.operation_id == op_id and worker.state.alive:
                    await self._stop_worker(worker)
                    await asyncio.to_thread(
                        self._workers.update, worker.id, state=WorkerState.STOPPED, operation_id=""
                    )
        target = self._workers.find(step.new_worker_id) if step.new_worker_id else None
        if target is not None and target.state.alive:
            await self._stop_worker(target)
            await asyncio.to_thread(
                self._workers.update,
                target.id,
                state=WorkerState.STOPPED,
                operation_id="",
                sessions=(),
            )
        source = self._workers.find(step.worker_id)
        if source is not None and source.operation_id != op_id:
            source = None  # the step never took it (a failed check, or another operation's)
        if source is not None:
            if step.kind is StepKind.RETIRE and source.endpoint:  # take new sessions again
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self._clients.worker(source.endpoint).SetDraining(
                        worker_pb2.SetWorkerDrainingRequest(draining=False), timeout=RPC_TIMEOUT_S
                    )
            if PHASES.index(step.phase) >= PHASES.index("target_started"):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self._clients.worker(source.endpoint).Resume(
                        worker_pb2.WorkerResumeRequest(), timeout=RPC_TIMEOUT_S
                    )
            if source.state.alive:
                await asyncio.to_thread(
                    self._workers.update, source.id, state=WorkerState.SERVING, operation_id=""
                )
        await self._save_step(
            op_id, step.index, state=StepState.ROLLED_BACK, error=why, finished_at=self._clock()
        )

    async def _stop_worker(self, worker: WorkerRecord, deadline_s: float = 120.0) -> None:
        """Stop a worker through its agent, retrying while the agent is down or restarting."""
        if not worker.endpoint:
            return
        give_up = time.monotonic() + deadline_s
        delay = 0.2
        while True:
            try:
                agent = self._clients.agent(self._registry.get(worker.node).agent_address)
                await agent.StopWorker(
                    agent_pb2.StopWorkerRequest(worker_id=worker.id), timeout=RPC_TIMEOUT_S
                )
                return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return  # already gone
                if time.monotonic() > give_up:
                    raise FailedPrecondition(
                        f"could not stop worker {worker.id!r} on {worker.node!r}: {err.details()}",
                        field="worker_id",
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- persistence helpers ------------------------------------------------------------------
    async def _phase(self, op_id: str, step: Step, phase: str, **changes: object) -> Step:
        saved = await self._save_step(op_id, step.index, phase=phase, **changes)
        await asyncio.to_thread(self._failpoints.hit, f"after:{phase}")
        return saved

    async def _save_step(self, op_id: str, index: int, **changes: object) -> Step:
        op = await asyncio.to_thread(self._ops.update_step, op_id, index, **changes)
        return op.steps[index]

    async def _save(self, op_id: str, **changes: object) -> Operation:
        return await asyncio.to_thread(self._ops.update, op_id, **changes)


# An agent's answers that mean the same to the executor's caller; others fail the step.
_AGENT_PASSES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


def agent_error(err: grpc.aio.AioRpcError, node: str) -> FleetShiftError:
    """An agent's refusal, re-raised with the same meaning and the node named."""
    return peer_error(
        err,
        f"agent of node {node!r}",
        passes=_AGENT_PASSES,
        default=FailedPrecondition,
        field="node_name",
    )


def _before(step: Step, phase: str) -> bool:
    return PHASES.index(step.phase) < PHASES.index(phase)


def _with_role(worker: WorkerRecord, role: Role) -> WorkerSpec:
    return dataclasses.replace(worker.spec, role=role)
