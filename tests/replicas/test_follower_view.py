"""A follower's view over the real store: what the leader wrote arrives on refresh, what the
heartbeats said stays, and a follower's share of a heartbeat never writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeState,
    Registration,
    WorkerCounters,
)
from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.operations import OperationKind, OperationLog
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.core.workers import WorkerRecord, WorkerReport, WorkerSpec, WorkerTable
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_daemon.store.work_store import SqlOperationStore, SqlWorkerStore

SPEC = WorkerSpec("m", Role.MIXED)


def test_follower_tables_follow_the_leaders_writes(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db'}")
    upgrade(engine)
    token = SqlLeaseStore(engine).acquire("leader", "l:1", ttl_s=60).token
    leader = WorkerTable(SqlWorkerStore(engine, lambda: token), lambda: 1.0)
    follower = WorkerTable(SqlWorkerStore(engine, lambda: None), lambda: 1.0)  # may not write
    heard: list[int] = []
    follower.on_change(lambda: heard.append(1))

    leader.add(WorkerRecord("w1", "n1", SPEC, (0,), "127.0.0.1:7", WorkerState.SERVING, 1.0))
    assert follower.find("w1") is None
    assert follower.refresh() and follower.get("w1").endpoint == "127.0.0.1:7" and heard

    report = WorkerReport(
        "w1", SPEC, (0,), "127.0.0.1:7", WorkerState.SERVING,
        counters=WorkerCounters("w1", live_sessions=1), sessions=("s1",),
    )  # fmt: skip
    stranger = WorkerReport("w9", SPEC, (1,), "127.0.0.1:8", WorkerState.SERVING)
    follower.observe("n1", [report, stranger])  # would raise Deposed if it tried to write
    assert follower.locate_session("s1") is not None and follower.find("w9") is None

    heard.clear()
    assert not follower.refresh() and not heard  # nothing durable changed: no index rebuild
    assert follower.get("w1").sessions == ("s1",)  # the heartbeat's sessions survive a refresh
    leader.update("w1", state=WorkerState.DRAINING)
    assert follower.refresh() and follower.get("w1").state is WorkerState.DRAINING
    assert follower.get("w1").sessions == ("s1",)
    leader.remove("w1")
    assert follower.refresh() and follower.find("w1") is None


def test_follower_operation_log_tells_watchers_of_each_change(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db'}")
    upgrade(engine)
    token = SqlLeaseStore(engine).acquire("leader", "l:1", ttl_s=60).token
    leader = OperationLog(SqlOperationStore(engine, lambda: token), lambda: 5.0)
    follower = OperationLog(SqlOperationStore(engine, lambda: None), lambda: 5.0)
    seen: list[str] = []
    follower.on_change(lambda op: seen.append(op.state.value))
    op, _ = leader.create(OperationKind.DRAIN, "t", "r", (), idempotency_key="k1")
    assert [o.id for o in follower.refresh()] == [op.id] and seen == ["pending"]
    assert follower.refresh() == []
    leader.update(op.id, cancel_requested=True)
    assert follower.refresh()[0].cancel_requested
    assert follower.find_by_key("k1", {}) is not None  # idempotency keys known on a follower


def test_a_follower_hears_a_lost_node_come_back_without_writing(tmp_path: Path) -> None:
    """Whether a node is lost or back is the leader's to write (it hears the same heartbeat);
    a follower's heartbeat changes its own view only, where a write would be refused."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db'}")
    upgrade(engine)
    token = SqlLeaseStore(engine).acquire("leader", "l:1", ttl_s=60).token
    leader = Registry(SqlRegistryStore(engine, lambda: token), lambda: 1.0, lost_after_s=5)
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 << 30)
    leader.register(
        Registration("n1", "10.0.0.9:1", (gpu,), inventory_source=InventorySource.DECLARED)
    )
    SqlRegistryStore(engine, lambda: token).update_status("n1", NodeState.LOST, False, "")
    follower = Registry(SqlRegistryStore(engine, lambda: None), lambda: 1.0, lost_after_s=5)
    follower.load()
    assert follower.get("n1").state is NodeState.LOST
    assert follower.heartbeat("n1", record=False).state is NodeState.READY  # no Deposed
    assert SqlRegistryStore(engine).load_nodes()[0].state is NodeState.LOST  # nothing written
    follower.load()
    follower.heartbeat("n1")  # recorded: written by the sweep, off the event loop
    with pytest.raises(Deposed):
        follower.sweep()  # were it to write, the fence would refuse it
