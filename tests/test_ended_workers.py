"""Ended workers leave the registry after the retention, through the real daemon.

Every move and retirement leaves its source behind as a STOPPED record and every vanished
worker as a FAILED one; kept forever they grow the registry (and each heartbeat's, Route's
and a follower's walk over it) with the fleet's whole history. An agent is played by a real
gRPC client heartbeating two declared workers; the daemon, its SQL store, its liveness sweep
and ListWorkers are the real ones; retention is read from an injected clock the test moves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import Engine

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.config import DaemonConfig, PlannerSettings
from fleetshift_daemon.app import Daemon
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
from .test_registry_api import registration

NODE = "h100-1"
RETENTION_S = 600.0


def worker(worker_id: str, first_gpu: int) -> fpb.WorkerStatus:
    return fpb.WorkerStatus(
        worker_id=worker_id,
        model="llama-70b",
        role=fpb.WORKER_ROLE_MIXED,
        tensor_parallel=4,
        dtype="bf16",
        gpu_indices=list(range(first_gpu, first_gpu + 4)),
        endpoint=f"127.0.0.1:{9001 + first_gpu}",
        state=fpb.WORKER_STATE_SERVING,
        counters=fpb.WorkerCounters(worker_id=worker_id, kv_blocks_total=100_000),
    )


def config(tmp_path: Path, url: str, **keys: float) -> DaemonConfig:
    """A daemon sweeping every 0.1 s, with no planning pass of its own (none adds records)."""
    return DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=1e6,  # the node stays up on the manual clock
        liveness_check_interval_s=0.1,
        planner=PlannerSettings(interval_s=0.0),
        **{"ended_worker_retention_s": RETENTION_S, **keys},
    )


@pytest.fixture
async def clock() -> ManualClock:
    return ManualClock(time.time())


@pytest.fixture
async def daemon(tmp_path: Path, sqlite_url: str, clock: ManualClock) -> AsyncIterator[Daemon]:
    d = Daemon(config(tmp_path, sqlite_url), clock=clock)
    await d.start()
    try:
        yield d
    finally:
        await d.stop(0.1)


async def listed(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        answer = await pb_grpc.PlanningStub(ch).ListWorkers(pb.ListWorkersRequest())
    return {w.worker_id: w.state for w in answer.workers}


async def listed_after_sweeps(port: int) -> dict[str, int]:
    await asyncio.sleep(0.5)  # five sweeps at 0.1 s
    return await listed(port)


async def listed_once_pruned(port: int, worker_id: str, timeout_s: float = 10.0) -> dict[str, int]:
    """The list once ``worker_id`` has left it, or as it stands at ``timeout_s``: a sweep
    delayed on a loaded machine must not fail the test, a sweep that never prunes must."""
    deadline = time.monotonic() + timeout_s
    while worker_id in (workers := await listed(port)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return workers


async def test_a_vanished_worker_is_listed_until_the_retention_then_deleted(
    daemon: Daemon, clock: ManualClock, sqlite_url: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        await agents.RegisterNode(registration(NODE, gpus=8))
        both = [worker("w1", 0), worker("w2", 4)]
        await agents.Heartbeat(fpb.HeartbeatRequest(node_name=NODE, workers=both))
        # w1 is gone from the agent's report: the daemon marks it failed and keeps it listed
        await agents.Heartbeat(fpb.HeartbeatRequest(node_name=NODE, workers=[worker("w2", 4)]))
    assert await listed(daemon.port) == {
        "w1": fpb.WORKER_STATE_FAILED,
        "w2": fpb.WORKER_STATE_SERVING,
    }
    clock.advance(RETENTION_S - 1.0)
    assert set(await listed_after_sweeps(daemon.port)) == {"w1", "w2"}
    clock.advance(1.0)
    assert await listed_once_pruned(daemon.port, "w1") == {"w2": fpb.WORKER_STATE_SERVING}
    # deleted from the database, not only from this process's table
    stored = SqlWorkerStore(make_engine(sqlite_url)).load_workers()
    assert [w.id for w in stored] == ["w2"]


def stopped(table: WorkerTable, worker_id: str, **changes: object) -> None:
    table.add(
        WorkerRecord(
            id=worker_id,
            node="node-a",
            spec=WorkerSpec("llama-70b", Role.MIXED, tp=4),
            gpu_indices=(0, 1, 2, 3),
            endpoint="127.0.0.1:9100",
            state=WorkerState.SERVING,
            created_at=0.0,
        )
    )
    table.update(worker_id, state=WorkerState.STOPPED, **changes)


def engine_for(db_url: str) -> Engine:
    engine = make_engine(db_url)
    upgrade(engine)
    return engine


def test_pruning_spares_live_and_owned_workers_and_tells_who_forgot(db_url: str) -> None:
    clock = ManualClock(1000.0)
    engine = engine_for(db_url)
    table = WorkerTable(SqlWorkerStore(engine), clock)
    table.load()
    forgotten: list[str] = []
    table.on_forget(forgotten.append)
    stopped(table, "done")
    stopped(table, "owned", operation_id="op-1")  # an operation still holds it
    table.reconcile("node-a", [live_report("alive")])
    clock.advance(RETENTION_S)
    assert table.prune_ended(RETENTION_S) == ["done"]
    assert forgotten == ["done"]
    assert {w.id for w in table.all()} == {"owned", "alive"}
    # a follower's view drops it at its next refresh and tells its own listeners
    follower = WorkerTable(SqlWorkerStore(engine), clock)
    follower_forgot: list[str] = []
    follower.on_forget(follower_forgot.append)
    stopped(table, "later")
    follower.load()
    clock.advance(RETENTION_S)
    assert table.prune_ended(RETENTION_S) == ["later"]
    follower.refresh()
    assert follower_forgot == ["later"]
    assert {w.id for w in follower.all()} == {"owned", "alive"}


def test_a_restart_counts_the_retention_again_from_the_load(db_url: str) -> None:
    clock = ManualClock(1000.0)
    engine = engine_for(db_url)
    first = WorkerTable(SqlWorkerStore(engine), clock)
    first.load()
    stopped(first, "old")
    clock.advance(RETENTION_S - 10.0)
    restarted = WorkerTable(SqlWorkerStore(engine), clock)
    restarted.load()  # it cannot know when "old" ended: it saw it ended now
    clock.advance(10.0)
    assert restarted.prune_ended(RETENTION_S) == []
    clock.advance(RETENTION_S)
    assert restarted.prune_ended(RETENTION_S) == ["old"]


def live_report(worker_id: str) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id,
        spec=WorkerSpec("llama-70b", Role.MIXED, tp=4),
        gpu_indices=(4, 5, 6, 7),
        endpoint="127.0.0.1:9101",
        state=WorkerState.SERVING,
    )
