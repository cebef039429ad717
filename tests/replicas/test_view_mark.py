"""The mark a follower compares before re-reading the database, on real PostgreSQL.

Every durable write the follower's view is read from (a node registered, lost or cordoned, a
worker written or deleted, an operation) must change the mark; the leader's batched heartbeat
times, rewritten every sweep, must not (or the mark would save nothing). SQLite, which serves
one daemon that never follows, has no mark.
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import Engine

from fleetshift_daemon.core.fleet import NodeState
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_daemon.store.view_mark import view_mark
from fleetshift_daemon.store.work_store import SqlOperationStore, SqlWorkerStore

from .test_lease_store import node, operation, worker


def fresh(url: str) -> Engine:
    engine = make_engine(url)
    upgrade(engine)
    return engine


def test_every_durable_write_changes_the_mark_and_heartbeat_times_do_not(pg_url: str) -> None:
    engine = fresh(pg_url)
    nodes, workers, ops = (
        SqlRegistryStore(engine),
        SqlWorkerStore(engine),
        SqlOperationStore(engine),
    )
    marks = [view_mark(engine)]

    def changed() -> bool:
        marks.append(view_mark(engine))
        return marks[-1] != marks[-2]

    nodes.save_node(node("n1"))
    assert changed()
    nodes.record_heartbeats({"n1": 50.0})
    assert not changed()  # the leader's sweep rewrites these every interval
    nodes.update_status("n1", NodeState.READY, True, "maintenance")
    assert changed()
    nodes.update_status("n1", NodeState.LOST, True, "maintenance")
    assert changed()
    nodes.save_node(dataclasses.replace(node("n1"), agent_address="10.0.0.10:50052"))
    assert changed()
    workers.save_worker(worker("w1"))
    assert changed()
    workers.save_worker(dataclasses.replace(worker("w1"), endpoint="127.0.0.1:10"))
    assert changed()
    workers.delete_worker("w1")
    assert changed()
    ops.save_operation(operation("op-1"))
    assert changed()
    assert not changed()  # nothing written: the same mark
    engine.dispose()


def test_sqlite_has_no_mark(sqlite_url: str) -> None:
    engine = fresh(sqlite_url)
    assert view_mark(engine) is None
    engine.dispose()
