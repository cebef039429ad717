"""The lease row on real SQLite and PostgreSQL, and the database refusing a deposed leader.

A TTL of 0 makes a lease expire at once on the database's own clock, so a takeover needs no
sleeping: the next transaction already sees it expired.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from fleetshift_common.config import DaemonConfig
from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeRecord,
    NodeState,
    NodeVersions,
)
from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.operations import Operation, OperationKind, OperationState
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_daemon.store.models import NodeRow, OperationRow, WorkerRow
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_daemon.store.traffic_store import SqlArrivalStore
from fleetshift_daemon.store.work_store import SqlOperationStore, SqlWorkerStore


@pytest.fixture
def engine(db_url: str) -> Engine:
    engine = make_engine(db_url)
    upgrade(engine)
    return engine


def row_time(ts: float, engine: Engine) -> datetime:
    """A timestamp as the dialect returns it (SQLite keeps no zone)."""
    moment = datetime.fromtimestamp(ts, tz=UTC)
    return moment.replace(tzinfo=None) if engine.dialect.name == "sqlite" else moment


def operation(op_id: str) -> Operation:
    return Operation(op_id, OperationKind.MOVE_WORKER, OperationState.RUNNING, "test", "", 1.0, 1.0)


def worker(worker_id: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id, "n1", WorkerSpec("m", Role.MIXED), (0,), "127.0.0.1:9", WorkerState.SERVING, 1.0
    )


def test_one_holder_at_a_time_and_each_takeover_raises_the_token(engine: Engine) -> None:
    leases = SqlLeaseStore(engine)
    a = leases.acquire("a", "10.0.0.1:1", ttl_s=60)
    assert a.held_by_me and a.token == 1
    refused = leases.acquire("b", "10.0.0.2:1", ttl_s=60)
    assert not refused.held_by_me and refused.holder == "a" and refused.address == "10.0.0.1:1"
    assert leases.renew("a", 1, ttl_s=0).held_by_me  # renewed, but to expire at once
    b = leases.acquire("b", "10.0.0.2:1", ttl_s=60)
    assert b.held_by_me and b.token == 2
    late = leases.renew("a", 1, ttl_s=60)  # the old leader's renewal comes too late
    assert not late.held_by_me and late.holder == "b" and late.token == 2


def test_a_write_with_a_stale_token_is_refused_and_changes_nothing(engine: Engine) -> None:
    leases = SqlLeaseStore(engine)
    old = leases.acquire("a", "a:1", ttl_s=0).token
    new = leases.acquire("b", "b:1", ttl_s=60).token
    assert new == old + 1
    deposed_ops = SqlOperationStore(engine, fence=lambda: old)
    deposed_workers = SqlWorkerStore(engine, fence=lambda: old)
    with pytest.raises(Deposed, match=f"fencing token {old} is stale"):
        deposed_ops.save_operation(operation("op-stale"))
    with pytest.raises(Deposed, match="another daemon leads"):
        deposed_workers.save_worker(worker("w-stale"))
    with pytest.raises(Deposed):
        deposed_workers.delete_worker("w-any")
    with engine.connect() as conn:
        assert conn.execute(select(OperationRow.id)).all() == []
        assert conn.execute(select(WorkerRow.id)).all() == []
    SqlOperationStore(engine, fence=lambda: new).save_operation(operation("op-current"))
    SqlWorkerStore(engine, fence=lambda: new).save_worker(worker("w-current"))
    assert [o.id for o in SqlOperationStore(engine).load_operations()] == ["op-current"]
    assert [w.id for w in SqlWorkerStore(engine).load_workers()] == ["w-current"]


def node(name: str, cordoned: bool = False) -> NodeRecord:
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 << 30, "hbm3", "9.0")
    return NodeRecord(
        name, "10.0.0.9:50052", NodeState.READY, InventorySource.DECLARED, NodeVersions(),
        (gpu,), registered_at=1.0, last_heartbeat_at=1.0, cordoned=cordoned,
    )  # fmt: skip


def test_the_registry_refuses_a_deposed_leaders_decisions(engine: Engine) -> None:
    """A node turned lost, a cordon, the batched heartbeat times: each is the leader's word,
    refused with a stale token and rolled back, and accepted with the current one."""
    leases = SqlLeaseStore(engine)
    old = leases.acquire("a", "a:1", ttl_s=0).token
    new = leases.acquire("b", "b:1", ttl_s=60).token
    SqlRegistryStore(engine).save_node(node("n1"))  # an agent registered (any replica takes it)
    deposed = SqlRegistryStore(engine, fence=lambda: old)
    with pytest.raises(Deposed, match=f"fencing token {old} is stale"):
        deposed.update_status("n1", NodeState.LOST, True, "deposed leader's cordon")
    with pytest.raises(Deposed):
        deposed.record_heartbeats({"n1": 99.0})
    with pytest.raises(Deposed, match="does not lead"):
        SqlRegistryStore(engine, fence=lambda: None).update_status("n1", NodeState.LOST, False, "")
    with engine.connect() as conn:
        row = conn.execute(select(NodeRow.state, NodeRow.cordoned, NodeRow.last_heartbeat_at))
        assert [tuple(r) for r in row] == [("ready", False, row_time(1.0, engine))]
    leader = SqlRegistryStore(engine, fence=lambda: new)
    leader.update_status("n1", NodeState.READY, True, "disk")
    leader.record_heartbeats({"n1": 5.0})
    [stored] = SqlRegistryStore(engine).load_nodes()
    assert stored.cordoned and stored.cordon_reason == "disk" and stored.last_heartbeat_at == 5.0


def test_a_registration_keeps_the_leaders_cordon(engine: Engine) -> None:
    """A follower whose view has not caught up with a cordon registers the node again (the
    agent restarted): the inventory is the agent's to state, the cordon stays the leader's."""
    token = SqlLeaseStore(engine).acquire("a", "a:1", ttl_s=60).token
    SqlRegistryStore(engine).save_node(node("n1"))
    SqlRegistryStore(engine, fence=lambda: token).update_status("n1", NodeState.READY, True, "x")
    stale_view = dataclasses.replace(node("n1", cordoned=False), agent_address="10.0.0.9:60000")
    SqlRegistryStore(engine, fence=lambda: None).save_node(stale_view)  # unfenced, accepted
    [stored] = SqlRegistryStore(engine).load_nodes()
    assert stored.agent_address == "10.0.0.9:60000"
    assert stored.cordoned and stored.cordon_reason == "x"


def test_a_process_that_does_not_lead_cannot_write(engine: Engine) -> None:
    SqlLeaseStore(engine).acquire("a", "a:1", ttl_s=60)
    with pytest.raises(Deposed, match="does not lead"):
        SqlOperationStore(engine, fence=lambda: None).save_operation(operation("op-x"))


def test_release_hands_the_lease_over_at_once(engine: Engine) -> None:
    leases = SqlLeaseStore(engine)
    token = leases.acquire("a", "a:1", ttl_s=600).token
    assert not leases.acquire("b", "b:1", ttl_s=600).held_by_me
    assert leases.release("a", token)
    assert leases.acquire("b", "b:1", ttl_s=600).held_by_me
    assert not leases.release("a", token)  # no longer its lease to release


def test_a_second_daemon_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    """SQLite serves one daemon: the second exits with a message pointing at PostgreSQL."""
    import asyncio

    config = tmp_path / "d.toml"
    config.write_text(f'listen = "127.0.0.1:0"\nstate_dir = "{tmp_path}"\n')

    async def second_while_first_runs() -> subprocess.CompletedProcess[str]:
        first = Daemon(DaemonConfig(listen="127.0.0.1:0", state_dir=str(tmp_path)))
        await first.start()
        try:
            return await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            await first.stop(grace_s=0.1)

    second = asyncio.run(second_while_first_runs())
    assert second.returncode == 2
    assert "SQLite serves one daemon" in second.stderr and "PostgreSQL" in second.stderr


def test_route_arrivals_travel_as_ages_and_a_deposed_leader_cannot_purge(engine: Engine) -> None:
    """What a replica publishes reaches another once, without the reader's own rows, aged on
    the database's clock; dropping old rows is the leader's (fenced) decision."""
    leases = SqlLeaseStore(engine)
    old = leases.acquire("a", "a:1", ttl_s=0).token
    new = leases.acquire("b", "b:1", ttl_s=60).token
    store = SqlArrivalStore(engine)
    store.publish("follower", 1, {"m": [(0.5, 100, 20.0), (0.1, 7, 3.0)], "idle": []})
    store.publish("b", 1, {"m": [(0.0, 1, 1.0)]})  # the reader's own row
    [row] = store.since("b", max_age_s=300)
    assert (row.replica, row.model) == ("follower", "m")
    assert row.arrivals == ((0.5, 100, 20.0), (0.1, 7, 3.0)) and 0 <= row.age_s < 30
    assert store.since("b", max_age_s=300, skip={row.id}) == []  # taken in already
    with pytest.raises(Deposed):
        SqlArrivalStore(engine, fence=lambda: old).purge(older_than_s=0)
    assert len(store.since("", max_age_s=300)) == 2
    assert SqlArrivalStore(engine, fence=lambda: new).purge(older_than_s=-60) == 2
    assert store.since("", max_age_s=300) == []


def test_a_retried_publication_is_written_once(engine: Engine) -> None:
    """A publication whose commit landed although the call failed (the connection dropped
    before the answer) is sent again under the same number: the database refuses the copy,
    and a reader counts those arrivals once. Another number, or another replica's, goes in."""
    store = SqlArrivalStore(engine)
    first = {"m": [(0.5, 100, 20.0)], "n": [(0.2, 5, 1.0)]}
    assert store.publish("a", 7, first) is True
    assert store.publish("a", 7, {"m": [(1.5, 100, 20.0)], "n": [(1.2, 5, 1.0)]}) is False
    assert store.publish("a", 8, {"m": [(0.1, 9, 9.0)]}) is True
    assert store.publish("b", 7, {"m": [(0.1, 9, 9.0)]}) is True
    rows = store.since("reader", max_age_s=300)
    assert sorted((r.replica, r.model, r.arrivals) for r in rows) == [
        ("a", "m", ((0.1, 9, 9.0),)),
        ("a", "m", ((0.5, 100, 20.0),)),
        ("a", "n", ((0.2, 5, 1.0),)),
        ("b", "m", ((0.1, 9, 9.0),)),
    ]
