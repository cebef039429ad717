"""The daemon's worker table as heartbeats and the executor write to it, on a real SQL store."""

from __future__ import annotations

from sqlalchemy import Engine

from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.workers import (
    WorkerRecord,
    WorkerReport,
    WorkerSpec,
    WorkerState,
    WorkerTable,
)
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.work_store import SqlWorkerStore

from .clock import ManualClock


def report(role: Role, role_epoch: int) -> WorkerReport:
    return WorkerReport(
        worker_id="w1",
        spec=WorkerSpec("llama-70b", role, tp=4),
        gpu_indices=(0, 1, 2, 3),
        endpoint="127.0.0.1:9100",
        state=WorkerState.SERVING,
        role_epoch=role_epoch,
    )


def loaded(engine: Engine) -> WorkerRecord:
    """The worker as the next daemon would load it."""
    table = WorkerTable(SqlWorkerStore(engine), ManualClock(1000.0))
    table.load()
    return table.get("w1")


def test_a_heartbeat_polled_before_a_role_change_does_not_undo_it(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    table = WorkerTable(SqlWorkerStore(engine), ManualClock(1000.0))
    table.load()
    table.reconcile("node-a", [report(Role.PREFILL, 0)])

    # The executor's SetRole answered with epoch 1; then a heartbeat polled before it arrives.
    table.update("w1", spec=WorkerSpec("llama-70b", Role.DECODE, tp=4), role_epoch=1)
    table.reconcile("node-a", [report(Role.PREFILL, 0)])
    assert table.get("w1").spec.role is Role.DECODE
    assert loaded(engine).spec.role is Role.DECODE

    # The next poll carries the change; a later change made on the worker itself wins.
    table.reconcile("node-a", [report(Role.DECODE, 1)])
    assert table.get("w1").spec.role is Role.DECODE
    table.reconcile("node-a", [report(Role.MIXED, 2)])
    assert table.get("w1").spec.role is Role.MIXED

    assert loaded(engine).spec.role is Role.MIXED
    engine.dispose()
