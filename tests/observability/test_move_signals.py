"""The daemon's snapshot-phase and pause histograms follow the phases the operation log records.

A real ``OperationLog`` (on SQLite) with the listener the daemon installs, stepped through the
phases the executor persists, with a manual clock: each phase's duration is the time between
the two persisted phases around it, the pause is the step's own figure, each is observed once,
and a phase whose start this process never saw is not guessed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fleetshift_common.vocabulary import StepPhase
from fleetshift_daemon.core.operations import (
    OperationKind,
    OperationLog,
    Step,
    StepKind,
    StepState,
)
from fleetshift_daemon.move_signals import MoveSignals
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.work_store import SqlOperationStore
from fleetshift_rpc.metrics import DaemonMetrics
from tests.clock import ManualClock


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def log(tmp_path: Path) -> OperationLog:
    engine = make_engine(f"sqlite:///{tmp_path / 'ops.db'}")
    upgrade(engine)
    ops = OperationLog(SqlOperationStore(engine), ManualClock(1000.0))
    ops.load()
    return ops


def run_phases(
    ops: OperationLog, kind: StepKind, phases: list[tuple[str, float]], clock: ManualClock
) -> None:
    op, _ = ops.create(OperationKind.MOVE_WORKER, "test", "", (Step(0, kind, "w-1", "h100-b"),))
    ops.update_step(op.id, 0, state=StepState.RUNNING)
    for phase, seconds in phases:
        clock.advance(seconds)
        pause = {"max_session_pause_ms": 250.0} if phase == "sessions_copied" else {}
        ops.update_step(op.id, 0, phase=StepPhase(phase), **pause)
    ops.update_step(op.id, 0, phase=StepPhase.DONE, state=StepState.DONE)
    ops.update_step(
        op.id, 0, phase=StepPhase.DONE
    )  # a later save of the finished step changes nothing


WARM = [
    ("target_reserved", 0.1),
    ("snapshot_taken", 2.0),
    ("snapshot_fetched", 3.0),
    ("target_started", 4.0),
    ("source_paused", 1.0),
    ("sessions_copied", 0.5),
    ("switched", 0.1),
    ("source_retired", 1.0),
]


def test_a_warm_move_observes_each_snapshot_phase_and_its_pause_once(log: OperationLog) -> None:
    metrics, clock = DaemonMetrics(), ManualClock(0.0)
    log.on_change(MoveSignals(metrics, clock))
    run_phases(log, StepKind.MIGRATE, WARM, clock)
    r = metrics.registry
    for phase, seconds in (("write", 2.0), ("transfer", 3.0), ("restore", 4.0)):
        assert sample(r, "fleetshift_snapshot_duration_seconds_count", phase=phase) == 1
        assert sample(r, "fleetshift_snapshot_duration_seconds_sum", phase=phase) == pytest.approx(
            seconds
        )
    assert sample(r, "fleetshift_session_pause_seconds_count") == 1
    assert sample(r, "fleetshift_session_pause_seconds_sum") == 0.25


def test_a_cold_move_has_a_pause_and_no_snapshot_phases(log: OperationLog) -> None:
    metrics, clock = DaemonMetrics(), ManualClock(0.0)
    log.on_change(MoveSignals(metrics, clock))
    cold = [p for p in WARM if not p[0].startswith("snapshot")]
    run_phases(log, StepKind.COLD_START, cold, clock)
    r = metrics.registry
    for phase in ("write", "transfer", "restore"):
        assert sample(r, "fleetshift_snapshot_duration_seconds_count", phase=phase) == 0
    assert sample(r, "fleetshift_session_pause_seconds_count") == 1


def test_a_phase_begun_before_a_restart_is_not_timed(log: OperationLog) -> None:
    """A daemon that starts with a step already past target_reserved cannot know when the
    snapshot began: it reports the transfer and restore it saw, not a made-up write."""
    metrics, clock = DaemonMetrics(), ManualClock(0.0)
    signals = MoveSignals(metrics, clock)
    op, _ = log.create(
        OperationKind.MOVE_WORKER, "test", "", (Step(0, StepKind.MIGRATE, "w-1", "h100-b"),)
    )
    log.update_step(op.id, 0, state=StepState.RUNNING, phase=StepPhase.TARGET_RESERVED)
    log.on_change(signals)  # the new process starts listening here
    for phase in ("snapshot_taken", "snapshot_fetched", "target_started"):
        clock.advance(1.0)
        log.update_step(op.id, 0, phase=StepPhase(phase))
    r = metrics.registry
    assert sample(r, "fleetshift_snapshot_duration_seconds_count", phase="write") == 0
    assert sample(r, "fleetshift_snapshot_duration_seconds_count", phase="transfer") == 1
    assert sample(r, "fleetshift_snapshot_duration_seconds_count", phase="restore") == 1
