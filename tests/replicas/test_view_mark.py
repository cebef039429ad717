"""The mark a follower compares before re-reading the database, on real PostgreSQL.

Every durable write the follower's view is read from (a node registered, lost or cordoned, a
worker written or deleted, an operation) must change the mark; the leader's batched heartbeat
times, rewritten every sweep, must not (or the mark would save nothing). SQLite, which serves
one daemon that never follows, has no mark.
"""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import Boolean, DateTime, Engine, Integer, String, text

from fleetshift_daemon.core.fleet import NodeState
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.models import NodeRow
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


def _changed_value(column_type: object) -> str:
    """SQL for a new value of a column of this type, whatever the row held."""
    if isinstance(column_type, Boolean):
        return "NOT {c}"
    if isinstance(column_type, Integer):
        return "{c} + 1000"
    if isinstance(column_type, DateTime):
        return "{c} + interval '1 day'"
    assert isinstance(column_type, String), column_type
    return "{c} || 'x'"


@pytest.mark.parametrize(
    "column", [c.name for c in NodeRow.__table__.columns if c.name != "last_heartbeat_at"]
)
def test_every_column_of_a_node_but_its_heartbeat_time_is_in_the_mark(
    pg_url: str, column: str
) -> None:
    """A follower re-reads the registry only when the mark says so: a node column the digest
    leaves out would be a change followers miss until their next full read (minutes)."""
    engine = fresh(pg_url)
    store = SqlRegistryStore(engine)
    store.save_node(dataclasses.replace(node("n1"), gpus=()))  # no GPU rows hold its id
    before = view_mark(engine)
    update = _changed_value(NodeRow.__table__.columns[column].type).format(c=f'"{column}"')
    with engine.begin() as conn:
        # the column and its new value come from the ORM's own table, not from any input
        conn.execute(text(f'UPDATE nodes SET "{column}" = {update}'))  # noqa: S608
    assert view_mark(engine) != before
    engine.dispose()


def _xid(conn) -> int:  # type: ignore[no-untyped-def]
    """The 32-bit transaction id of this connection's transaction (taking one if needed)."""
    return int(conn.execute(text("SELECT txid_current() % 4294967296")).scalar_one())


def _plain_mark(engine: Engine) -> tuple[int, int]:
    """The mark before 2026-12-05: the count and the plain sum of the rows' ``xmin``."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT count(*), sum(xmin::text::bigint) FROM workers")).one()
    return int(row[0]), int(row[1])


def test_an_older_transactions_late_writes_that_cancel_in_a_plain_sum_change_the_mark(
    pg_url: str,
) -> None:
    """Transaction ids are taken at the first write, not at commit. T1 takes its id, a younger
    T2 updates worker B and commits, and the follower reads. Then T1 rewrites B (its ``xmin``
    falls from T2's id to T1's) and a worker A written just before T1 (rises to T1's id by as
    much): a plain sum of ``xmin`` stays the same and the follower would miss both changes.
    The hashed sum does not. The exact ids depend on the server's other traffic, so the pair
    is built until an A with the cancelling id exists (checked on the plain sum itself)."""
    engine = fresh(pg_url)
    workers = SqlWorkerStore(engine)
    for attempt in range(20):
        candidates = [f"a{attempt}-{i}" for i in range(8)]
        for worker_id in [f"b{attempt}", *candidates]:  # the candidates' ids just below T1's
            workers.save_worker(worker(worker_id))
        with engine.connect() as t1:
            t1.begin()
            x1 = _xid(t1)
            workers.save_worker(dataclasses.replace(worker(f"b{attempt}"), endpoint="t2:1"))
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT id, xmin::text::bigint FROM workers")).all()
            xmins = dict(rows)
            a = next((w for w in candidates if 2 * x1 - xmins[f"b{attempt}"] == xmins[w]), None)
            if a is None:
                t1.rollback()
                continue
            plain, before = _plain_mark(engine), view_mark(engine)
            t1.execute(
                text("UPDATE workers SET endpoint = 't1:1' WHERE id IN (:a, :b)"),
                {"a": a, "b": f"b{attempt}"},
            )
            t1.commit()
        assert _plain_mark(engine) == plain  # the case is real: the old mark misses it
        assert view_mark(engine) != before
        engine.dispose()
        return
    pytest.fail("no cancelling pair in 20 attempts: the server's other traffic took the ids")


def test_sqlite_has_no_mark(sqlite_url: str) -> None:
    engine = fresh(sqlite_url)
    assert view_mark(engine) is None
    engine.dispose()
