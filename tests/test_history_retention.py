"""Finished operations and efficiency samples leave the database after the retention.

Every planning pass that acts and every operator request leaves an operation behind, and
every pass an efficiency sample; kept forever, a follower's full re-read and the daemon's own
copy grow with the fleet's whole history. The stores are the real SQL ones (SQLite and
PostgreSQL), the daemon and its ListOperations the real ones; time is an injected clock the
test moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import Engine

from fleetshift.v1 import operations_pb2 as opb
from fleetshift.v1 import operations_pb2_grpc as opb_grpc
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.operations import (
    PRUNE_BATCH,
    Operation,
    OperationKind,
    OperationLog,
    OperationNotFound,
    OperationState,
)
from fleetshift_daemon.core.placement import EfficiencySample
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.work_store import SqlEfficiencyStore, SqlOperationStore

from .clock import ManualClock
from .test_ended_workers import config

RETENTION_S = 7 * 86400.0
REQUEST = {"node": "h100-1"}


def engine_for(db_url: str) -> Engine:
    engine = make_engine(db_url)
    upgrade(engine)
    return engine


def loaded_log(engine: Engine, clock: ManualClock) -> OperationLog:
    """A daemon's operation log over the SQL store, loaded as one does at start."""
    log = OperationLog(SqlOperationStore(engine), clock)
    log.load()
    return log


def create(log: OperationLog, key: str = "") -> tuple[Operation, bool]:
    return log.create(OperationKind.DRAIN, "ops", "test", (), idempotency_key=key, request=REQUEST)


def record(log: OperationLog, state: OperationState, key: str = "") -> Operation:
    op, _ = create(log, key)
    return log.update(op.id, state=state) if state is not OperationState.PENDING else op


def stored_ids(engine: Engine) -> set[str]:
    return {op.id for op in SqlOperationStore(engine).load_operations()}


def test_only_operations_finished_before_the_retention_are_deleted(db_url: str) -> None:
    clock = ManualClock(1_000_000.0)
    engine = engine_for(db_url)
    log = loaded_log(engine, clock)
    done = record(log, OperationState.SUCCEEDED, key="k-old")
    failed = record(log, OperationState.FAILED)
    running = record(log, OperationState.RUNNING)  # never pruned, however old
    clock.advance(RETENTION_S - 1.0)
    recent = record(log, OperationState.CANCELLED)
    assert log.prune_finished(RETENTION_S) == []
    # the key is still honoured: the same request returns the first operation
    again, created = create(log, key="k-old")
    assert (again.id, created) == (done.id, False)
    clock.advance(1.0)
    assert log.prune_finished(RETENTION_S) == []  # exactly the retention: kept
    clock.advance(0.001)
    assert log.prune_finished(RETENTION_S) == sorted([done.id, failed.id])
    assert stored_ids(engine) == {running.id, recent.id}
    assert {op.id for op in log.list()} == {running.id, recent.id}
    with pytest.raises(OperationNotFound):
        log.get(done.id)
    # after the retention the same key starts a new operation
    fresh, created = create(log, key="k-old")
    assert created and fresh.id != done.id


def test_a_follower_forgets_what_the_leader_pruned(db_url: str) -> None:
    clock = ManualClock(1_000_000.0)
    engine = engine_for(db_url)
    leader = loaded_log(engine, clock)
    old = record(leader, OperationState.SUCCEEDED, key="k1")
    kept = record(leader, OperationState.RUNNING)
    follower = loaded_log(engine, clock)
    assert follower.get(old.id) == old
    clock.advance(RETENTION_S + 1.0)
    assert leader.prune_finished(RETENTION_S) == [old.id]
    follower.refresh()
    assert [op.id for op in follower.list()] == [kept.id]
    assert follower.find_by_key("k1", REQUEST) is None


def test_a_large_backlog_is_deleted_in_batches(db_url: str) -> None:
    """The first prune after an upgrade meets every operation ever finished: more ids than
    one statement may carry on SQLite, so the deletes go in batches."""
    clock = ManualClock(1_000_000.0)
    engine = engine_for(db_url)
    store = SqlOperationStore(engine)
    count = 2 * PRUNE_BATCH + 7
    template = Operation(
        id="",
        kind=OperationKind.REBALANCE,
        state=OperationState.SUCCEEDED,
        requested_by="planner",
        reason="backlog",
        created_at=clock(),
        updated_at=clock(),
    )
    for i in range(count):
        store.save_operation(dataclasses.replace(template, id=f"op-{i:05d}"))
    log = loaded_log(engine, clock)
    clock.advance(RETENTION_S + 1.0)
    assert len(log.prune_finished(RETENTION_S)) == count
    assert stored_ids(engine) == set()


def test_efficiency_samples_before_the_cutoff_are_deleted(db_url: str) -> None:
    store = SqlEfficiencyStore(engine_for(db_url))
    for t in (100.0, 200.0, 300.0):
        store.add(EfficiencySample(t, 0.9, 10.0, 11.0))
    assert store.prune_before(200.0) == 1
    assert [s.taken_at for s in store.recent()] == [200.0, 300.0]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time())


@pytest.fixture
def seeded(sqlite_url: str, clock: ManualClock) -> tuple[str, str]:
    """An old and a recent finished operation and an old efficiency sample, written before
    the daemon starts, as an earlier run of it would have left them."""
    engine = engine_for(sqlite_url)
    log = loaded_log(engine, clock)
    old = record(log, OperationState.SUCCEEDED)
    SqlEfficiencyStore(engine).add(EfficiencySample(clock(), 0.8, 8.0, 10.0))
    clock.advance(RETENTION_S / 2)
    recent = record(log, OperationState.FAILED)
    engine.dispose()
    return old.id, recent.id


@pytest.fixture
async def daemon(
    tmp_path: Path, sqlite_url: str, clock: ManualClock, seeded: tuple[str, str]
) -> AsyncIterator[Daemon]:
    d = Daemon(config(tmp_path, sqlite_url, history_retention_s=RETENTION_S), clock=clock)
    await d.start()
    try:
        yield d
    finally:
        await d.stop(0.1)


async def listed(port: int) -> set[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        answer = await opb_grpc.OperationsStub(ch).ListOperations(opb.ListOperationsRequest())
    return {op.id for op in answer.operations}


async def listed_once_pruned(port: int, op_id: str, timeout_s: float = 10.0) -> set[str]:
    """The list once ``op_id`` has left it, or as it stands at ``timeout_s``: a sweep delayed
    on a loaded machine must not fail the test, a sweep that never prunes must."""
    deadline = time.monotonic() + timeout_s
    while op_id in (ops := await listed(port)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return ops


async def test_the_daemon_deletes_history_past_the_retention(
    daemon: Daemon, clock: ManualClock, seeded: tuple[str, str], sqlite_url: str
) -> None:
    old, recent = seeded
    assert await listed(daemon.port) == {old, recent}
    await asyncio.sleep(0.5)  # sweeps run; nothing is due yet
    assert await listed(daemon.port) == {old, recent}
    clock.advance(RETENTION_S / 2 + 1.0)
    assert await listed_once_pruned(daemon.port, old) == {recent}
    engine = make_engine(sqlite_url)
    assert stored_ids(engine) == {recent}
    assert SqlEfficiencyStore(engine).recent() == []
