"""The lease row on real SQLite and PostgreSQL, and the database refusing a deposed leader.

A TTL of 0 makes a lease expire at once on the database's own clock, so a takeover needs no
sleeping: the next transaction already sees it expired.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine, select

from fleetshift_common.config import DaemonConfig
from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.operations import Operation, OperationKind, OperationState
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_daemon.store.models import OperationRow, WorkerRow
from fleetshift_daemon.store.work_store import SqlOperationStore, SqlWorkerStore


@pytest.fixture
def engine(db_url: str) -> Engine:
    engine = make_engine(db_url)
    upgrade(engine)
    return engine


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
