"""The daemon's worker table as heartbeats and the executor write to it, on a real SQL store."""

from __future__ import annotations

import dataclasses

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


def report(
    role: Role, role_epoch: int, sessions: tuple[str, ...] = (), worker_id: str = "w1"
) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id,
        spec=WorkerSpec("llama-70b", role, tp=4),
        gpu_indices=(0, 1, 2, 3) if worker_id == "w1" else (4, 5, 6, 7),
        endpoint=f"127.0.0.1:{9100 if worker_id == 'w1' else 9101}",
        state=WorkerState.SERVING,
        role_epoch=role_epoch,
        sessions=sessions,
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


def test_a_session_that_ended_while_its_client_was_away_is_located_where_it_ended(
    db_url: str,
) -> None:
    """A move's target can finish a carried session before the client re-attaches; the
    worker keeps its tokens, so LocateSession must still name it (it answered NOT_FOUND,
    and the client waited for a session that would never reappear)."""
    engine = make_engine(db_url)
    upgrade(engine)
    table = WorkerTable(SqlWorkerStore(engine), ManualClock(1000.0))
    table.load()
    table.reconcile("node-a", [report(Role.MIXED, 0, ("s-1", "s-2"))])
    table.reconcile("node-b", [report(Role.MIXED, 0, (), worker_id="w2")])

    # The executor hands the sessions to w2 at the switch and empties w1.
    table.update("w2", sessions=("s-1", "s-2"))
    table.update("w1", sessions=())
    assert table.locate_session("s-1").id == "w2"  # type: ignore[union-attr]

    # w2 finishes s-1 before its client asks: its report lists only s-2.
    table.reconcile("node-b", [report(Role.MIXED, 0, ("s-2",), worker_id="w2")])
    assert table.locate_session("s-1").id == "w2"  # type: ignore[union-attr]
    assert table.locate_session("s-2").id == "w2"  # type: ignore[union-attr]

    # A session no worker ever listed is unknown; one whose last worker is gone is too.
    assert table.locate_session("s-never") is None
    table.reconcile("node-b", [])  # w2 vanished: failed
    assert table.locate_session("s-1") is None
    engine.dispose()


def test_a_restarted_daemon_locates_a_session_from_its_workers_unread_report(
    db_url: str,
) -> None:
    """The trail of where sessions ended lives in memory: a daemon restarted after a
    session finished on a move's target relearns it from the worker's report of the
    sessions it finished that no client has read (a leader's and a follower's table alike)."""
    engine = make_engine(db_url)
    upgrade(engine)
    unread = dataclasses.replace(report(Role.MIXED, 0, ("s-2",), worker_id="w2"), unread=("s-1",))
    for heard in ("reconcile", "observe"):
        table = WorkerTable(SqlWorkerStore(engine), ManualClock(1000.0))
        table.load()  # a fresh daemon: it knows w2 (stored) but not where s-1 ended
        if heard == "reconcile":
            table.reconcile("node-b", [report(Role.MIXED, 0, ("s-2",), worker_id="w2")])
        assert table.locate_session("s-1") is None, heard
        getattr(table, heard)("node-b", [unread])
        assert table.locate_session("s-1").id == "w2", heard  # type: ignore[union-attr]
        assert table.locate_session("s-2").id == "w2", heard  # type: ignore[union-attr]
    # Once a client has read it the worker stops listing it; the daemon still remembers.
    table.reconcile("node-b", [report(Role.MIXED, 0, ("s-2",), worker_id="w2")])
    assert table.locate_session("s-1").id == "w2"  # type: ignore[union-attr]
    engine.dispose()


def test_only_workers_this_daemon_created_have_a_known_birth(db_url: str) -> None:
    """A worker adopted from a heartbeat (the daemon did not start it) has counters that may
    predate this daemon, so the traffic mix must take its first report as a baseline."""
    engine = make_engine(db_url)
    upgrade(engine)
    table = WorkerTable(SqlWorkerStore(engine), ManualClock(1000.0))
    table.load()
    table.reconcile("node-a", [report(Role.MIXED, 0)])  # nobody ordered w1: adopted
    assert table.born_at(table.get("w1")) is None
    created = WorkerRecord(
        id="w2",
        node="node-b",
        spec=WorkerSpec("llama-70b", Role.MIXED, tp=4),
        gpu_indices=(4, 5, 6, 7),
        endpoint="127.0.0.1:9101",
        state=WorkerState.STARTING,
        created_at=1000.0,
    )
    table.add(created)
    assert table.born_at(table.get("w2")) == 1000.0
    engine.dispose()
