"""Executing operations: each step a persisted phase machine, make-before-break.

This is where FleetShift **moves** workers. A step runs through phases, and each phase is
written to the operation log before the next action starts (``SEQUENCES`` lists them per step
kind):

    planned -> target_reserved -> [snapshot_taken -> snapshot_fetched] -> target_started
            -> source_paused -> sessions_copied -> switched -> source_retired -> done

(the bracketed phases only for a warm migrate to the same GPU model). A retirement of a surplus
worker is ``planned -> draining -> switched -> source_retired -> done``: the router stops
sending it sessions and the worker refuses new ones, the executor waits until it has none, and
only then stops it; sessions still live at the drain deadline roll the step back and the worker
takes sessions again. A role change and a start are one action each (``planned -> done``).

The rule (``FORWARD_FROM``): until ``switched`` the source worker serves, or holds its sessions
paused; a failure anywhere before it rolls back: the target is stopped, the source resumed,
nothing lost. From ``switched`` on the target owns every session and the step is completed
forward whatever happens. A daemon that restarts applies the same rule to the phase it finds in
the log, so every session has exactly one worker, and the operation records which way it went.

Sessions move in two stages on a warm migrate: each is copied with its KV to the target as a
held copy while the source keeps decoding, then the source pauses at a step boundary and only
the small deltas (new tokens, sampling state, the last KV blocks) follow, so the pause does not
grow with the context (Llumnix). A cold start carries the token history instead, recomputed at
the target. Either way the target continues generating at once and the source cancels its
copies only after the switch, so its clients' streams end with ABORTED "moved" and they
re-attach through ``LocateSession`` at the token they reached.

Every call to an agent or a worker goes through the injected ``FleetClient``; nothing here knows
gRPC. Its errors are FleetShift errors with one-sentence messages, and that sentence is what an
operator reads in a failed step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from fleetshift_common.blocking import in_thread
from fleetshift_common.errors import FailedPrecondition, FleetShiftError
from fleetshift_common.failpoints import Failpoints
from fleetshift_common.vocabulary import Role, StepPhase, WorkerState
from fleetshift_daemon.core.fleet import NodeState
from fleetshift_daemon.core.fleet_client import (
    AgentRef,
    FleetClient,
    SessionEnded,
    WorkerAlreadyRuns,
    WorkerGone,
    WorkerLaunch,
    WorkerRef,
)
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
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec, WorkerTable

log = logging.getLogger("fleetshift.daemon.executor")

P = StepPhase
SEQUENCES: Mapping[StepKind, tuple[StepPhase, ...]] = {
    StepKind.MIGRATE: (
        P.TARGET_RESERVED,
        P.SNAPSHOT_TAKEN,
        P.SNAPSHOT_FETCHED,
        P.TARGET_STARTED,
        P.SOURCE_PAUSED,
        P.SESSIONS_COPIED,
        P.SWITCHED,
        P.SOURCE_RETIRED,
        P.DONE,
    ),
    StepKind.COLD_START: (
        P.TARGET_RESERVED,
        P.TARGET_STARTED,
        P.SOURCE_PAUSED,
        P.SESSIONS_COPIED,
        P.SWITCHED,
        P.SOURCE_RETIRED,
        P.DONE,
    ),
    StepKind.RETIRE: (P.DRAINING, P.SWITCHED, P.SOURCE_RETIRED, P.DONE),
    StepKind.ROLE_CHANGE: (P.DONE,),
    StepKind.START: (P.DONE,),
}
FORWARD_FROM = P.SWITCHED  # from here on a step is completed, never rolled back


def rolls_forward(phase: StepPhase) -> bool:
    """The rule for a step cut short at ``phase``: complete it (True) or roll it back."""
    return phase.rank >= FORWARD_FROM.rank


class PhaseHook(Protocol):
    """Called (from a thread) after each phase is persisted, ``after:<phase>``, and at
    named points inside a phase, ``during:<point>`` (``during:precopied``: every session
    staged on the target, the source not yet paused): where tests crash the daemon."""

    def hit(self, name: str) -> None: ...


class MoveMetrics(Protocol):
    def operation_finished(self, kind: str, outcome: str, duration_s: float | None) -> None: ...

    def step_moved(self, step_kind: str, bytes_moved: int, snapshot_bytes: int = 0) -> None: ...


@dataclass(frozen=True)
class ExecutionSettings:
    drain_timeout_s: float = 600.0  # a retirement's sessions must end within this
    drain_settle_s: float = 2.0  # a retiring worker must stay idle this long before it stops
    drain_poll_s: float = 0.5
    stop_deadline_s: float = 120.0  # retrying a stop while an agent is down or restarting
    precopy_rounds: int = 8


class Executor:
    def __init__(
        self,
        ops: OperationLog,
        registry: Registry,
        workers: WorkerTable,
        placement: PlacementService,
        fleet: FleetClient,
        metrics: MoveMetrics | None = None,
        clock: Callable[[], float] = time.time,
        failpoints: PhaseHook | None = None,
        settings: ExecutionSettings | None = None,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._ops = ops
        self._registry = registry
        self._workers = workers
        self._placement = placement
        self._fleet = fleet
        self._metrics = metrics
        self._clock = clock
        self._monotonic = monotonic
        self._sleep = sleep
        self._failpoints: PhaseHook = failpoints or Failpoints()
        self.settings = settings or ExecutionSettings()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cause = "the daemon restarted"  # why a recovered step was cut short
        self._replan = False  # run such a step again (leader change) instead of failing

    # -- lifecycle ---------------------------------------------------------------------------
    def submit(self, op: Operation, recovering: bool = False) -> None:
        if op.id in self._tasks and not self._tasks[op.id].done():
            return
        task = asyncio.create_task(self._run(op.id, recovering), name=f"operation {op.id}")
        self._tasks[op.id] = task
        task.add_done_callback(lambda done: self._forget(op.id, done))

    def _forget(self, op_id: str, task: asyncio.Task[None]) -> None:
        """A finished operation's task leaves the table (its record stays in the log)."""
        if self._tasks.get(op_id) is task:
            del self._tasks[op_id]

    def recover(self, cause: str = "the daemon restarted", replan: bool = False) -> list[str]:
        """Resume every operation a previous daemon process (or a previous leader) left
        unfinished; ``cause`` opens the error of a step that had to be rolled back.

        With ``replan`` (a new leader taking over) a rolled-back step that still holds (its
        source serves, its target is ready with the GPUs free) is run again as a new step
        instead of failing the operation; otherwise the operation fails as after a restart."""
        self._cause, self._replan = cause, replan
        resumed = []
        for op in self._ops.list(limit=10_000, unfinished_only=True):
            log.warning("resuming operation: %s", cause, extra={"operation": op.id})
            self.submit(op, recovering=True)
            resumed.append(op.id)
        return resumed

    async def abandon(self) -> None:
        """Stop acting at once (this replica was deposed): cancel every running operation
        where it stands. Its record stays as the last write left it; the next leader recovers
        it by the same rule as after a restart."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stop(self) -> None:
        await self.abandon()
        await self._fleet.close()

    async def wait_idle(self) -> None:
        """Until every operation submitted so far has ended (however it ended)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    def running(self) -> list[Operation]:
        return [self._ops.get(i) for i, t in list(self._tasks.items()) if not t.done()]

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
        await in_thread(self._workers.add, record)
        launch = WorkerLaunch(
            worker_id=record.id,
            model=spec.model,
            model_dir=served.model_dir if served else "",
            engine=served.engine if served else "reference",
            engine_args_json=served.engine_args_json if served else "",
            role=spec.role,
            tp=spec.tp,
            dtype=spec.dtype,
            gpu_indices=gpus,
        )
        try:
            endpoint = await self._fleet.start_worker(self._agent(node), launch)
        except FleetShiftError:
            await in_thread(self._workers.remove, record.id)
            raise
        return await in_thread(
            self._workers.update,
            record.id,
            endpoint=endpoint,
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
        return await in_thread(
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
                failed = f"step {step.index} ({step.kind.value} of {_subject(step)}): {err}"
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
            if rolls_forward(step.phase):
                await self._finish_forward(op.id, step)
                return ""
            why = f"{self._cause} during step {step.index} at phase {step.phase.value!r}"
            await self._rollback(op.id, step, why)
            if not self._replan:
                return why + "; rolled back"
            blocked = self._still_valid(step)
            if blocked:
                return f"{why}; rolled back, not re-planned: {blocked}"
            await self._append_retry(op.id, step)
            log.warning("step %d re-planned after: %s", step.index, why, extra={"operation": op.id})
            return ""
        return ""

    def _still_valid(self, step: Step) -> str:
        """Why a rolled-back step cannot simply run again now ("" when it can): its source
        must serve, free, and its target node must be ready with the planned GPUs free."""
        if step.worker_id:
            source = self._workers.find(step.worker_id)
            if source is None or source.state is not WorkerState.SERVING or source.operation_id:
                return f"worker {step.worker_id!r} no longer serves free of other work"
        if step.target_node and step.kind is not StepKind.RETIRE:
            node = self._registry.get(step.target_node)
            if node.state is not NodeState.READY or node.cordoned:
                return f"node {step.target_node!r} is {node.state.value}, cordoned={node.cordoned}"
            taken = self._workers.gpus_in_use(step.target_node) & set(step.target_gpus)
            if taken:
                return f"GPUs {sorted(taken)} of {step.target_node!r} are in use"
        return ""

    async def _append_retry(self, op_id: str, step: Step) -> None:
        """The same step again, from the start, as the operation's next step."""
        op = self._ops.get(op_id)
        retry = Step(
            index=len(op.steps),
            kind=step.kind,
            worker_id=step.worker_id,
            target_node=step.target_node,
            target_role=step.target_role,
            target_gpus=step.target_gpus,
            model=step.model,
            tp=step.tp,
            dtype=step.dtype,
            predicted_gain=step.predicted_gain,
            predicted_pause_s=step.predicted_pause_s,
        )
        await self._save(op_id, steps=(*op.steps, retry))

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
            if rolls_forward(step.phase):
                await self._finish_forward(op_id, step)  # the target owns the sessions now
                return
            await self._rollback(op_id, step, str(err))
            raise

    async def _role_change(self, op_id: str, step: Step) -> None:
        worker = self._workers.get(step.worker_id)
        role = _role(step)
        epoch = await self._fleet.set_role(_ref(worker), role)
        await in_thread(
            self._workers.update,
            worker.id,
            spec=dataclasses.replace(worker.spec, role=role),
            role_epoch=epoch,  # a heartbeat polled before the change must not undo it
        )
        await self._save_step(
            op_id, step.index, phase=P.DONE, state=StepState.DONE, finished_at=self._clock()
        )

    async def _start_step(self, op_id: str, step: Step) -> None:
        spec = WorkerSpec(step.model, _role(step), step.tp, step.dtype or Dtype.BF16)
        worker = await self.start_worker(spec, step.target_node, step.target_gpus, owner=op_id)
        await self._save_step(
            op_id,
            step.index,
            phase=P.DONE,
            state=StepState.DONE,
            new_worker_id=worker.id,
            finished_at=self._clock(),
        )

    async def _retire(self, op_id: str, step: Step) -> None:
        """Drain, then stop: the worker takes no new session and is stopped once it has none."""
        worker = self._workers.get(step.worker_id)
        if _before(step, P.DRAINING):
            if worker.state is not WorkerState.SERVING or worker.operation_id:
                raise FailedPrecondition(
                    f"worker {worker.id!r} is {worker.state.value}, not serving and free",
                    field="worker_id",
                )
            await in_thread(
                self._workers.update, worker.id, state=WorkerState.DRAINING, operation_id=op_id
            )
            step = await self._phase(op_id, step, P.DRAINING)
        if _before(step, P.SWITCHED):
            await self._fleet.set_draining(_ref(worker), True)
            await self._wait_drained(op_id, worker)
            step = await self._phase(op_id, step, P.SWITCHED)
        await self._finish_forward(op_id, step)

    async def _wait_drained(self, op_id: str, worker: WorkerRecord) -> None:
        """Until the worker, which now refuses new sessions, has served none for the settle
        time: a session opened just before it was told to drain may still be starting."""
        cfg = self.settings
        give_up = self._monotonic() + cfg.drain_timeout_s
        idle_since: float | None = None
        while True:
            live = await self._fleet.live_sessions(_ref(worker))
            now = self._monotonic()
            if live:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            if idle_since is not None and now - idle_since >= cfg.drain_settle_s:
                return
            if self._ops.get(op_id).cancel_requested:
                raise FailedPrecondition("cancelled while draining", field="operation")
            if self._monotonic() > give_up:
                raise FailedPrecondition(
                    f"worker {worker.id!r} still serves {live} sessions after "
                    f"{cfg.drain_timeout_s:.0f} s of draining; it serves on",
                    field="worker_id",
                )
            await self._sleep(cfg.drain_poll_s)

    # -- a move, phase by phase ---------------------------------------------------------------
    async def _move(self, op_id: str, step: Step) -> None:
        source = self._workers.get(step.worker_id)
        warm = step.kind is StepKind.MIGRATE
        if _before(step, P.TARGET_RESERVED):
            step = await self._reserve(op_id, step, source)
        if warm and _before(step, P.SNAPSHOT_TAKEN):
            step = await self._snapshot(op_id, step, source)
        if warm and _before(step, P.SNAPSHOT_FETCHED):
            step = await self._fetch(op_id, step, source)
        if _before(step, P.TARGET_STARTED):
            step = await self._start_target(op_id, step, source, warm)
        if _before(step, P.SESSIONS_COPIED):
            step = await self._copy_sessions(op_id, step, source, warm)
        if _before(step, P.SWITCHED):
            step = await self._switch(op_id, step, source)
        await self._finish_forward(op_id, step)

    async def _reserve(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        new_id = f"w-{uuid.uuid4().hex[:10]}"
        # Owned by the step, but still serving: it takes new sessions while its target starts
        # (tens of seconds for a cold start), and stops only before its sessions are listed.
        await in_thread(self._workers.update, source.id, operation_id=op_id)
        target = WorkerRecord(
            id=new_id,
            node=step.target_node,
            spec=dataclasses.replace(source.spec, role=_role(step)),
            gpu_indices=step.target_gpus,
            endpoint="",
            state=WorkerState.STARTING,
            created_at=self._clock(),
            operation_id=op_id,
        )
        await in_thread(self._workers.add, target)
        return await self._phase(op_id, step, P.TARGET_RESERVED, new_worker_id=new_id)

    async def _snapshot(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        snapshot_id = f"{op_id}-{step.index}"
        size = await self._fleet.snapshot_worker(self._agent(source.node), source.id, snapshot_id)
        return await self._phase(
            op_id,
            step,
            P.SNAPSHOT_TAKEN,
            snapshot_id=snapshot_id,
            snapshot_bytes=size,
            bytes_moved=size,
        )

    async def _fetch(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        await self._fleet.fetch_snapshot(
            self._agent(step.target_node), self._agent(source.node), step.snapshot_id
        )
        return await self._phase(op_id, step, P.SNAPSHOT_FETCHED)

    async def _start_target(self, op_id: str, step: Step, source: WorkerRecord, warm: bool) -> Step:
        served = self._placement.models.get(source.spec.model)
        agent = self._agent(step.target_node)
        launch = WorkerLaunch(
            worker_id=step.new_worker_id,
            model=source.spec.model,
            model_dir=served.model_dir if served else "",
            engine=served.engine if served else "reference",
            engine_args_json=served.engine_args_json if served else "",
            role=_role(step),
            tp=source.spec.tp,
            dtype=source.spec.dtype,
            gpu_indices=step.target_gpus,
            restore_snapshot_id=step.snapshot_id if warm else "",
        )
        try:
            endpoint = await self._fleet.start_worker(agent, launch)
        except WorkerAlreadyRuns:  # a retry after a daemon restart
            endpoint = await self._fleet.worker_endpoint(agent, step.new_worker_id)
        await in_thread(self._workers.update, step.new_worker_id, endpoint=endpoint)
        return await self._phase(op_id, step, P.TARGET_STARTED)

    async def _copy_sessions(
        self, op_id: str, step: Step, source: WorkerRecord, warm: bool
    ) -> Step:
        """Pre-copy while the source decodes (warm moves), then pause it only for the deltas.

        The source keeps every session until the switch (nothing is released here), so a
        failure before it still rolls back to a source that lost nothing."""
        src = _ref(source)
        dst = _ref(self._workers.get(step.new_worker_id))
        # From here the source takes no new session: Route skips it, and the worker refuses
        # one routed just before (UNAVAILABLE: the client routes again), so every session it
        # holds is in the lists below.
        await in_thread(self._workers.update, source.id, state=WorkerState.DRAINING)
        await self._fleet.set_draining(src, True)
        bases: dict[str, int] = {}
        moved_bytes = 0
        with_kv = warm or self._kv_by_connector(source)
        # Pre-copy wherever the KV travels: a warm target, or a vLLM target its connector
        # feeds (the final delta then carries tokens, not the whole context's KV, so the
        # pause does not grow with the context). A cold reference target recomputes the
        # context anyway: pre-copy would not shorten it.
        if with_kv:
            bases, moved_bytes = await self._precopy(src, dst)
            await in_thread(self._failpoints.hit, "during:precopied")  # tests kill here
        paused_at = self._monotonic()
        await self._fleet.pause(src)
        step = await self._phase(op_id, step, P.SOURCE_PAUSED)
        moved = []
        kv_restored = 0
        for session_id in await self._fleet.session_ids(src):
            base = bases.get(session_id)
            try:
                exported = await self._fleet.export_session(
                    src, session_id, with_kv=with_kv, from_token=base or 0
                )
            except SessionEnded:
                continue  # finished meanwhile: nothing to carry (its held copy dies with it)
            delta_for = session_id if base is not None else ""
            kv_restored += await self._fleet.import_session(dst, exported.blob, delta_for=delta_for)
            moved.append(session_id)
            moved_bytes += len(exported.blob)
        pause_ms = (self._monotonic() - paused_at) * 1000
        await in_thread(self._workers.update, step.new_worker_id, sessions=tuple(moved))
        return await self._phase(
            op_id,
            step,
            P.SESSIONS_COPIED,
            sessions_carried=len(moved),
            sessions_kv_restored=kv_restored,
            bytes_moved=step.bytes_moved + moved_bytes,
            max_session_pause_ms=pause_ms,
        )

    def _kv_by_connector(self, source: WorkerRecord) -> bool:
        """A vLLM worker's cold move still offers each session's KV: vLLM's KV connector
        carries it to the fresh target, which takes it only where its compatibility key
        matches the source's and says per session whether it did (kv_restored)."""
        served = self._placement.models.get(source.spec.model)
        return served is not None and served.engine == "vllm"

    async def _precopy(self, src: WorkerRef, dst: WorkerRef) -> tuple[dict[str, int], int]:
        """Copy each live session with its KV to the target as a held (staged) copy, then
        catch up in rounds until a round finds at most one new token (Llumnix-style), or
        carries no KV: then the final delta is tokens only whenever it comes, and more
        rounds would not shorten the pause (a vLLM worker's, whose sessions decode on
        faster than rounds converge)."""
        bases: dict[str, int] = {}
        copied = 0
        for session_id in await self._fleet.session_ids(src):
            try:
                pre = await self._fleet.export_session(src, session_id, with_kv=True)
            except SessionEnded:
                continue
            await self._fleet.import_session(dst, pre.blob, staged=True)
            bases[session_id] = pre.tokens
            copied += len(pre.blob)
        for session_id in list(bases):
            for _ in range(self.settings.precopy_rounds):
                try:
                    more = await self._fleet.export_session(
                        src, session_id, with_kv=True, from_token=bases[session_id]
                    )
                except SessionEnded:
                    await self._fleet.cancel_session(dst, session_id)
                    del bases[session_id]
                    break
                await self._fleet.import_session(dst, more.blob, delta_for=session_id, staged=True)
                grew, bases[session_id] = more.tokens - bases[session_id], more.tokens
                copied += len(more.blob)
                if grew <= 1 or not more.kv_included:
                    break
        return bases, copied

    async def _switch(self, op_id: str, step: Step, source: WorkerRecord) -> Step:
        target = self._workers.get(step.new_worker_id)
        await in_thread(self._workers.update, target.id, state=WorkerState.SERVING, operation_id="")
        await in_thread(self._workers.update, source.id, state=WorkerState.DRAINING, sessions=())
        return await self._phase(op_id, step, P.SWITCHED)

    async def _finish_forward(self, op_id: str, step: Step) -> None:
        """From the switch on: end the source's copies of the sessions, retire it, done."""
        source = self._workers.find(step.worker_id)
        if source is not None and source.state.alive and _before(step, P.SOURCE_RETIRED):
            with contextlib.suppress(FleetShiftError):
                await self._cancel_all(source)
            await self._stop_worker(source)
            await in_thread(
                self._workers.update,
                source.id,
                state=WorkerState.STOPPED,
                operation_id="",
                sessions=(),
            )
            step = await self._phase(op_id, step, P.SOURCE_RETIRED)
        target = self._workers.find(step.new_worker_id)
        if target is not None and target.operation_id:
            await in_thread(
                self._workers.update, target.id, state=WorkerState.SERVING, operation_id=""
            )
        await self._save_step(
            op_id, step.index, phase=P.DONE, state=StepState.DONE, finished_at=self._clock()
        )
        if self._metrics is not None:
            done = self._ops.get(op_id).steps[step.index]
            self._metrics.step_moved(done.kind.value, done.bytes_moved, done.snapshot_bytes)

    async def _cancel_all(self, source: WorkerRecord) -> None:
        src = _ref(source)
        for session_id in await self._fleet.session_ids(src):
            with contextlib.suppress(FleetShiftError):
                await self._fleet.cancel_session(src, session_id)

    # -- undo ---------------------------------------------------------------------------------
    async def _rollback(self, op_id: str, step: Step, why: str) -> None:
        log.warning("rolling back step %d: %s", step.index, why, extra={"operation": op_id})
        if step.kind is StepKind.START:  # a start cut short: stop what it may have started
            for worker in self._workers.all(node=step.target_node):
                if worker.operation_id == op_id and worker.state.alive:
                    await self._stop_worker(worker)
                    await in_thread(
                        self._workers.update, worker.id, state=WorkerState.STOPPED, operation_id=""
                    )
        target = self._workers.find(step.new_worker_id) if step.new_worker_id else None
        if target is not None and target.state.alive:
            await self._stop_worker(target)
            await in_thread(
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
            if step.kind is not StepKind.ROLE_CHANGE and source.endpoint:  # take sessions again
                with contextlib.suppress(FleetShiftError):
                    await self._fleet.set_draining(_ref(source), False)
            if step.phase.rank >= P.TARGET_STARTED.rank:
                with contextlib.suppress(FleetShiftError):
                    await self._fleet.resume(_ref(source))
            if source.state.alive:
                await in_thread(
                    self._workers.update, source.id, state=WorkerState.SERVING, operation_id=""
                )
        await self._save_step(
            op_id, step.index, state=StepState.ROLLED_BACK, error=why, finished_at=self._clock()
        )

    async def _stop_worker(self, worker: WorkerRecord, deadline_s: float | None = None) -> None:
        """Stop a worker through its agent, retrying while the agent is down or restarting."""
        if not worker.endpoint:
            return
        limit = self.settings.stop_deadline_s if deadline_s is None else deadline_s
        give_up = self._monotonic() + limit
        delay = 0.2
        while True:
            agent = self._agent(worker.node)
            try:
                await self._fleet.stop_worker(agent, worker.id)
                return
            except WorkerGone:
                return  # already gone
            except FleetShiftError as err:
                if self._monotonic() > give_up:
                    raise FailedPrecondition(
                        f"could not stop worker {worker.id!r} on {worker.node!r}: {err}",
                        field="worker_id",
                    ) from None
                await self._sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- helpers -----------------------------------------------------------------------------
    def _agent(self, node: str) -> AgentRef:
        return AgentRef(node, self._registry.get(node).agent_address)

    async def _phase(self, op_id: str, step: Step, phase: StepPhase, **changes: object) -> Step:
        saved = await self._save_step(op_id, step.index, phase=phase, **changes)
        await in_thread(self._failpoints.hit, f"after:{phase.value}")
        return saved

    async def _save_step(self, op_id: str, index: int, **changes: object) -> Step:
        op = await in_thread(self._ops.update_step, op_id, index, **changes)
        return op.steps[index]

    async def _save(self, op_id: str, **changes: object) -> Operation:
        return await in_thread(self._ops.update, op_id, **changes)


def _before(step: Step, phase: StepPhase) -> bool:
    return step.phase.rank < phase.rank


def _ref(worker: WorkerRecord) -> WorkerRef:
    return WorkerRef(worker.id, worker.endpoint)


def _role(step: Step) -> Role:
    if step.target_role is None:
        raise FailedPrecondition(
            f"step {step.index} ({step.kind.value}) names no target role", field="target_role"
        )
    return step.target_role


def _subject(step: Step) -> str:
    return step.worker_id or f"a new {step.model} worker on {step.target_node}"
