"""The move phase machine, driven through every phase and every crash point.

The executor runs against the in-memory fleet of ``tests/fakefleet.py`` and the daemon's real
SQL stores (SQLite), so each case takes milliseconds. For each step kind and each phase of its
sequence, a failure right after the phase is persisted, a peer refusing the next call, or a
daemon restart at that point (the executor's task dies without running any cleanup; a new
executor on freshly loaded stores recovers) must end exactly as the rule says: rolled back
before ``switched``, completed from it on; and afterwards the registry and the fleet agree on
which workers serve, with every session on exactly one worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetshift_common.config import DaemonConfig, EngineArgs, ModelConfig
from fleetshift_common.errors import FailedPrecondition
from fleetshift_common.vocabulary import Role, StepPhase, WorkerState
from fleetshift_daemon import models
from fleetshift_daemon.core.execution import (
    SEQUENCES,
    ExecutionSettings,
    Executor,
)
from fleetshift_daemon.core.fleet import GpuInfo, InventorySource, Registration
from fleetshift_daemon.core.fleet_client import AgentRef, ExportedSession, WorkerLaunch, WorkerRef
from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.moves import MovePlanner, MoveRequest
from fleetshift_daemon.core.operations import (
    OperationKind,
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
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_daemon.store.work_store import (
    SqlEfficiencyStore,
    SqlOperationStore,
    SqlWorkerStore,
)

from .clock import ManualClock
from .fakefleet import FakeFleet

GiB = 1024**3
DECLARED = InventorySource.DECLARED
MODEL = "llama-70b"
NODES = {
    "h100-a": "NVIDIA H100 80GB HBM3",
    "h100-b": "NVIDIA H100 80GB HBM3",
    "h200-a": "NVIDIA H200",
}
SESSIONS = {"s1": 40, "s2": 75}
# The rule, written out: from the switch on the target owns the sessions and a step completes;
# before it, it rolls back.
FORWARD = {StepPhase.SWITCHED, StepPhase.SOURCE_RETIRED}
FAST = ExecutionSettings(drain_timeout_s=5.0, drain_settle_s=0.0, drain_poll_s=0.01)


class DaemonCrash(BaseException):
    """SIGKILL, as far as the executor can tell: no except clause of it runs."""


class PhaseHook:
    """The failpoint hook: after ``phase`` is persisted, fail the step or kill the daemon."""

    def __init__(self, phase: StepPhase | None = None, crash: bool = False) -> None:
        self.name = f"after:{phase.value}" if phase else ""
        self.crash = crash
        self.hits: list[str] = []

    def hit(self, name: str) -> None:
        self.hits.append(name)
        if name == self.name:
            self.name = ""  # once: the recovering daemon passes here again
            if self.crash:
                raise DaemonCrash(name)
            raise RuntimeError(f"scripted failure {name}")


@dataclass
class Daemon:
    """The parts of a daemon process the executor needs, loaded from one database."""

    registry: Registry
    workers: WorkerTable
    ops: OperationLog
    planner: MovePlanner
    executor: Executor


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.engine = make_engine(f"sqlite:///{tmp_path / 'fleetshift.db'}")
        upgrade(self.engine)
        self.clock = ManualClock(1_000_000.0)
        self.fleet = FakeFleet()
        config = DaemonConfig(
            models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4,)),)
        )
        self.models = models.served_models(config)

    def boot(self, hook: PhaseHook | None = None, metrics: object = None) -> Daemon:
        """A daemon process: everything loaded from the database, as at a start."""
        registry = Registry(SqlRegistryStore(self.engine), self.clock, 1e9)
        registry.load()
        workers = WorkerTable(SqlWorkerStore(self.engine), self.clock)
        workers.load()
        ops = OperationLog(SqlOperationStore(self.engine), self.clock)
        ops.load()
        placement = PlacementService(
            registry,
            workers,
            default_catalogue(),
            self.models,
            self.clock,
            SqlEfficiencyStore(self.engine),
        )
        executor = Executor(
            ops, registry, workers, placement, self.fleet, metrics, self.clock, hook, FAST,  # type: ignore[arg-type]
            sleep=_no_wait,
        )  # fmt: skip
        return Daemon(registry, workers, ops, MovePlanner(registry, workers, placement), executor)

    def populate(self, daemon: Daemon) -> None:
        for node, product in NODES.items():
            gpus = tuple(GpuInfo(i, product, 80 * GiB) for i in range(8))
            # declared: a fake fleet has no real GPUs, and its TP-4 reference workers are
            # nominal (on real GPUs the daemon refuses them, tests/test_engine_tp.py)
            reg = Registration(node, f"agent-{node}:1", gpus, inventory_source=DECLARED)
            daemon.registry.register(reg)
        for wid, node, role in (("src", "h100-a", Role.DECODE), ("other", "h200-a", Role.MIXED)):
            endpoint = f"fake://{wid}"
            daemon.workers.add(
                WorkerRecord(
                    wid, node, WorkerSpec(MODEL, role, 4, Dtype.BF16), (0, 1, 2, 3), endpoint,
                    WorkerState.SERVING, self.clock(),
                )
            )  # fmt: skip
            self.fleet.run(wid, node, role, SESSIONS if wid == "src" else {})


async def _no_wait(_: float) -> None:
    return None


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    w.populate(w.boot())
    yield w
    w.engine.dispose()


def step_for(daemon: Daemon, kind: StepKind) -> Step:
    if kind is StepKind.MIGRATE:
        return daemon.planner.move_step(MoveRequest("src", "h100-b"))
    if kind is StepKind.COLD_START:
        return daemon.planner.move_step(MoveRequest("src", "h200-a"))
    if kind is StepKind.ROLE_CHANGE:
        return daemon.planner.move_step(MoveRequest("src", "h100-a", target_role=Role.MIXED))
    if kind is StepKind.RETIRE:
        return Step(0, StepKind.RETIRE, "src", "h100-a", Role.DECODE)
    return Step(
        0, StepKind.START, "", "h100-b", Role.PREFILL, (4, 5, 6, 7), model=MODEL, tp=4,
        dtype=Dtype.BF16,
    )  # fmt: skip


def sessions_kept(kind: StepKind) -> dict[str, int]:
    """The sessions the fleet holds after the step, whichever way it ended: all of them, but
    a retirement waits for its worker's sessions to end first."""
    return {} if kind is StepKind.RETIRE else SESSIONS


async def run(world: World, daemon: Daemon, kind: StepKind) -> str:
    if kind is StepKind.RETIRE:
        world.fleet.workers["src"].sessions.clear()  # they streamed to their end
    step = step_for(daemon, kind)
    assert step.kind is kind
    op, _ = daemon.ops.create(OperationKind.MOVE_WORKER, "test", "phase machine", (step,))
    daemon.executor.submit(op)
    await daemon.executor.wait_idle()
    return op.id


def agree(world: World, daemon: Daemon, sessions: dict[str, int]) -> set[str]:
    """The registry's serving workers are exactly the fleet's running ones, each session is on
    exactly one worker, and no worker is left owned by an operation, paused or draining."""
    table = {w.id for w in daemon.workers.all() if w.state is WorkerState.SERVING}
    assert table == world.fleet.running()
    assert all(not w.state.alive for w in daemon.workers.all() if w.id not in table)
    assert all(not w.operation_id for w in daemon.workers.all())
    live = [s for w in world.fleet.workers.values() for s in w.sessions]
    assert sorted(live) == sorted(sessions)
    assert not any(w.paused or w.draining or w.staged for w in world.fleet.workers.values())
    return table


def completed(world: World, daemon: Daemon, op_id: str, kind: StepKind) -> None:
    op = daemon.ops.get(op_id)
    (step,) = op.steps
    assert (op.state, step.state, step.phase) == (
        OperationState.SUCCEEDED,
        StepState.DONE,
        StepPhase.DONE,
    ), op
    serving = agree(world, daemon, sessions_kept(kind))
    if kind in (StepKind.MIGRATE, StepKind.COLD_START):
        assert serving == {"other", step.new_worker_id}
        moved = world.fleet.workers[step.new_worker_id]
        assert moved.node == step.target_node and moved.sessions == SESSIONS
        assert daemon.workers.get("src").state is WorkerState.STOPPED
        assert step.sessions_carried == len(SESSIONS)
        assert (moved.restored_from == step.snapshot_id != "") is (kind is StepKind.MIGRATE)
    elif kind is StepKind.RETIRE:
        assert serving == {"other"}
    elif kind is StepKind.ROLE_CHANGE:
        assert world.fleet.workers["src"].role is Role.MIXED
        assert daemon.workers.get("src").spec.role is Role.MIXED


def rolled_back(world: World, daemon: Daemon, op_id: str, kind: StepKind, why: str) -> None:
    op = daemon.ops.get(op_id)
    (step,) = op.steps
    assert (op.state, step.state) == (OperationState.FAILED, StepState.ROLLED_BACK), op
    assert why in step.error and why in op.error
    assert "\n" not in op.error and "debug_error_string" not in op.error
    serving = agree(world, daemon, sessions_kept(kind))
    assert "src" in serving and world.fleet.workers["src"].sessions == sessions_kept(kind)
    assert world.fleet.workers["src"].role is Role.DECODE
    if kind is StepKind.START:
        assert serving == {"src", "other"}
    if step.new_worker_id:
        assert step.new_worker_id not in serving


CASES = [
    (kind, phase)
    for kind in (StepKind.MIGRATE, StepKind.COLD_START, StepKind.RETIRE)
    for phase in SEQUENCES[kind]
    if phase is not StepPhase.DONE  # reached without a hook: the step has ended
]


@pytest.mark.parametrize(("kind", "phase"), CASES, ids=lambda v: getattr(v, "value", v))
async def test_a_failure_right_after_a_phase_follows_the_rule(
    world: World, kind: StepKind, phase: StepPhase
) -> None:
    daemon = world.boot(PhaseHook(phase))
    op_id = await run(world, daemon, kind)
    if phase in FORWARD:
        completed(world, daemon, op_id, kind)
    else:
        rolled_back(world, daemon, op_id, kind, f"scripted failure after:{phase.value}")


@pytest.mark.parametrize(("kind", "phase"), CASES, ids=lambda v: getattr(v, "value", v))
async def test_a_daemon_restart_at_a_phase_follows_the_rule(
    world: World, kind: StepKind, phase: StepPhase
) -> None:
    first = world.boot(PhaseHook(phase, crash=True))
    op_id = await run(world, first, kind)
    op = first.ops.get(op_id)
    assert op.state is OperationState.RUNNING and op.steps[0].phase is phase  # cut short here
    second = world.boot()  # a new process: everything from the database
    assert second.executor.recover() == [op_id]
    await second.executor.wait_idle()
    if phase in FORWARD:
        completed(world, second, op_id, kind)
    else:
        why = f"the daemon restarted during step 0 at phase {phase.value!r}"
        rolled_back(world, second, op_id, kind, why)


@pytest.mark.parametrize("kind", list(SEQUENCES), ids=lambda k: k.value)
async def test_each_step_passes_exactly_its_phases_in_order(world: World, kind: StepKind) -> None:
    hook = PhaseHook()
    daemon = world.boot(hook)
    op_id = await run(world, daemon, kind)
    completed(world, daemon, op_id, kind)
    persisted = [StepPhase(h.removeprefix("after:")) for h in hook.hits if h.startswith("after:")]
    assert [*persisted, StepPhase.DONE] == list(SEQUENCES[kind])
    if kind is StepKind.MIGRATE:  # a warm move pre-copies after its target starts, then pauses
        at = hook.hits.index("during:precopied")
        assert hook.hits[at - 1 : at + 2 : 2] == ["after:target_started", "after:source_paused"]


# The fleet call each step kind makes, and the phase the step has reached when it is made.
REFUSALS = [
    (StepKind.MIGRATE, "snapshot_worker"),
    (StepKind.MIGRATE, "fetch_snapshot"),
    (StepKind.MIGRATE, "start_worker"),
    (StepKind.MIGRATE, "import_session"),
    (StepKind.MIGRATE, "pause"),
    (StepKind.COLD_START, "start_worker"),
    (StepKind.COLD_START, "export_session"),
    (StepKind.COLD_START, "import_session"),
    (StepKind.RETIRE, "set_draining"),
    (StepKind.RETIRE, "live_sessions"),
    (StepKind.ROLE_CHANGE, "set_role"),
    (StepKind.START, "start_worker"),
]


@pytest.mark.parametrize(("kind", "method"), REFUSALS, ids=lambda v: getattr(v, "value", v))
async def test_a_peer_refusing_before_the_switch_rolls_the_step_back(
    world: World, kind: StepKind, method: str
) -> None:
    daemon = world.boot()
    world.fleet.fail(method, FailedPrecondition(f"agent of node 'x': {method} refused (test)"))
    op_id = await run(world, daemon, kind)
    rolled_back(world, daemon, op_id, kind, f"{method} refused (test)")


async def test_a_peer_refusing_after_the_switch_does_not_undo_the_move(world: World) -> None:
    daemon = world.boot()
    world.fleet.fail("stop_worker")  # the source's agent, once: the stop is retried
    op_id = await run(world, daemon, StepKind.MIGRATE)
    completed(world, daemon, op_id, StepKind.MIGRATE)
    assert world.fleet.calls.count("stop_worker") == 2
    assert daemon.ops.get(op_id).steps[0].error == ""


async def test_a_session_that_ends_during_the_move_is_not_carried(world: World) -> None:
    daemon = world.boot()
    world.fleet.end_session("src", "s1", before="export_session", nth=3)  # after its pre-copy
    op_id = await run(world, daemon, StepKind.MIGRATE)
    op = daemon.ops.get(op_id)
    assert op.state is OperationState.SUCCEEDED and op.steps[0].sessions_carried == 1
    target = world.fleet.workers[op.steps[0].new_worker_id]
    assert target.sessions == {"s2": SESSIONS["s2"]} and not target.staged  # held copy dropped
    agree(world, daemon, {"s2": SESSIONS["s2"]})


async def test_the_snapshot_size_reaches_the_metric_as_bytes(world: World) -> None:
    seen: list[tuple[str, int, int]] = []

    class Metrics:
        def operation_finished(self, kind: str, outcome: str, duration_s: float | None) -> None:
            pass

        def step_moved(self, step_kind: str, bytes_moved: int, snapshot_bytes: int = 0) -> None:
            seen.append((step_kind, bytes_moved, snapshot_bytes))

    daemon = world.boot(metrics=Metrics())
    op_id = await run(world, daemon, StepKind.MIGRATE)
    step = daemon.ops.get(op_id).steps[0]
    assert step.snapshot_bytes == 4096 and step.sessions_carried == 2
    assert seen == [("migrate", step.bytes_moved, 4096)]


async def test_a_finished_operation_leaves_the_executors_task_table(world: World) -> None:
    daemon = world.boot()
    await run(world, daemon, StepKind.ROLE_CHANGE)
    assert daemon.executor.running() == []
    assert daemon.executor._tasks == {}


def test_steps_keep_their_typed_vocabulary_through_the_log(world: World) -> None:
    daemon = world.boot()
    step = dataclasses.replace(step_for(daemon, StepKind.START), phase=StepPhase.TARGET_STARTED)
    op, _ = daemon.ops.create(OperationKind.REBALANCE, "test", "types", (step,))
    again = world.boot().ops.get(op.id).steps[0]
    assert again == step
    assert (again.target_role, again.dtype, again.phase) == (
        Role.PREFILL,
        Dtype.BF16,
        StepPhase.TARGET_STARTED,
    )


async def test_a_vllm_model_moves_cold_even_to_its_own_gpu_model(tmp_path: Path) -> None:
    """vLLM workers have no snapshot here: the planner plans a cold start where the reference
    engine would move warm, and the target is started with the model's engine and arguments."""
    w = World(tmp_path)
    engine_args = EngineArgs(max_model_len=512)
    w.models = models.served_models(
        DaemonConfig(
            models=(
                ModelConfig(
                    name=MODEL, preset="llama2-70b", tp_options=(4,), engine="vllm",
                    engine_args=engine_args,
                ),
            )
        )
    )  # fmt: skip
    daemon = w.boot()
    w.populate(daemon)
    step = daemon.planner.move_step(MoveRequest("src", "h100-b"))  # H100 to H100
    assert step.kind is StepKind.COLD_START
    launched: list[WorkerLaunch] = []
    start = w.fleet.start_worker

    async def recording(agent: AgentRef, launch: WorkerLaunch) -> str:
        launched.append(launch)
        return await start(agent, launch)

    w.fleet.start_worker = recording  # type: ignore[method-assign]
    export = w.fleet.export_session

    async def decoding(
        worker: WorkerRef, session_id: str, *, with_kv: bool, from_token: int = 0
    ) -> ExportedSession:
        """As a vLLM worker on the disk connector: its sessions decode on between rounds,
        and a delta carries tokens only."""
        if not w.fleet.workers[worker.worker_id].paused:
            w.fleet.workers[worker.worker_id].sessions[session_id] += 5
        out = await export(worker, session_id, with_kv=with_kv, from_token=from_token)
        return dataclasses.replace(out, kv_included=with_kv and not from_token)

    w.fleet.export_session = decoding  # type: ignore[method-assign]
    op, _ = daemon.ops.create(OperationKind.MOVE_WORKER, "test", "vllm", (step,))
    daemon.executor.submit(op)
    await daemon.executor.wait_idle()
    assert daemon.ops.get(op.id).state is OperationState.SUCCEEDED
    (launch,) = launched
    assert (launch.engine, launch.restore_snapshot_id) == ("vllm", "")
    assert EngineArgs.from_json(launch.engine_args_json) == engine_args
    assert "snapshot_worker" not in w.fleet.calls
    # Its connector carries the KV across the cold move, so the sessions are pre-copied
    # while the source decodes and only deltas wait for the pause (flat in context).
    # One catch-up round each: a delta without KV would not shorten the pause however
    # many rounds ran, and a session that decodes on never lets the rounds converge.
    calls = w.fleet.calls
    paused = calls.index("pause")
    assert calls[:paused].count("export_session") == 2 * len(SESSIONS)
    assert calls[paused:].count("export_session") == len(SESSIONS)
    assert sorted(w.fleet.workers[launch.worker_id].sessions) == sorted(SESSIONS)
    w.engine.dispose()


async def test_a_reference_cold_move_pauses_before_it_exports(world: World) -> None:
    """A cold reference target recomputes every context anyway: no pre-copy, one export
    per session after the pause."""
    daemon = world.boot()
    await run(world, daemon, StepKind.COLD_START)
    calls = world.fleet.calls
    assert "export_session" not in calls[: calls.index("pause")]
    assert calls.count("export_session") == len(SESSIONS)


class Observer(PhaseHook):
    """Notes, after each phase, whether the source takes sessions (the registry routes to it,
    the worker does not refuse them); a client opens one more session on it as soon as its
    target has started."""

    def __init__(self, world: World, daemon: Daemon) -> None:
        super().__init__()
        self.world, self.daemon = world, daemon
        self.takes: dict[str, bool] = {}

    def hit(self, name: str) -> None:
        super().hit(name)
        record, worker = self.daemon.workers.get("src"), self.world.fleet.workers["src"]
        self.takes[name] = record.state is WorkerState.SERVING and not worker.draining
        if name == "after:target_started":
            worker.sessions["s-late"] = 12


@pytest.mark.parametrize("kind", [StepKind.MIGRATE, StepKind.COLD_START], ids=lambda k: k.value)
async def test_a_moving_worker_takes_sessions_until_its_target_has_started(
    world: World, kind: StepKind
) -> None:
    """Make-before-break: a target can take tens of seconds to start; its source serves new
    sessions meanwhile, stops taking them before its sessions are listed, and carries the
    late one with the rest."""
    observer = Observer(world, world.boot())
    daemon = observer.daemon = world.boot(observer)  # the hook reads the running daemon's table
    op_id = await run(world, daemon, kind)
    op = daemon.ops.get(op_id)
    assert op.state is OperationState.SUCCEEDED, op
    assert observer.takes["after:target_reserved"] and observer.takes["after:target_started"]
    assert not observer.takes["after:source_paused"]
    assert op.steps[0].sessions_carried == len(SESSIONS) + 1
    target = world.fleet.workers[op.steps[0].new_worker_id]
    assert set(target.sessions) == {*SESSIONS, "s-late"}


async def test_a_move_rolled_back_after_its_source_stopped_taking_sessions_takes_them_again(
    world: World,
) -> None:
    daemon = world.boot()
    world.fleet.fail("import_session", FailedPrecondition("import refused (test)"))
    op_id = await run(world, daemon, StepKind.COLD_START)
    rolled_back(world, daemon, op_id, StepKind.COLD_START, "import refused (test)")
    assert daemon.workers.get("src").state is WorkerState.SERVING
    assert not world.fleet.workers["src"].draining
