"""Route arrivals shared between daemon replicas, on real SQLite and PostgreSQL.

Each replica is a real ``TrafficMonitor`` (what Route feeds and the planner and GetTrafficMix
read) with its real ``TrafficShare`` on one database; the test plays their rounds in turn. What
must hold, whoever leads: every replica's window is the union of what each replica answered,
each arrival exactly once, and it stays so across a change of leader and a restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from fleetshift_daemon.core.traffic import TrafficConfig, TrafficMonitor
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_daemon.store.traffic_store import SqlArrivalStore
from fleetshift_daemon.traffic_share import TrafficShare


@pytest.fixture
def engine(db_url: str) -> Engine:
    engine = make_engine(db_url)
    upgrade(engine)
    return engine


class Replica:
    def __init__(
        self,
        engine: Engine,
        name: str,
        leader: list[str],
        token: list[int],
        store: SqlArrivalStore | None = None,
    ) -> None:
        self.name = name
        self.traffic = TrafficMonitor(time.time, TrafficConfig(window_s=300))
        if store is None:
            store = SqlArrivalStore(engine, fence=lambda: token[0] if leader[0] == name else None)
        self.share = TrafficShare(self.traffic, store, name, lambda: leader[0] == name, time.time)

    def answer(self, prompts: Iterable[int]) -> list[int]:
        """Route calls this replica answers: the prompt length tells them apart."""
        out = list(prompts)
        for p in out:
            self.traffic.observe_request("m", p, 1.0)
        return out

    def window(self) -> list[int]:
        return sorted(int(p) for p in self.traffic.arrivals("m")[1])


def rounds(replicas: Sequence[Replica], n: int = 1) -> None:
    for _ in range(n):
        for r in replicas:
            r.share.step()


def test_a_new_leader_counts_every_replicas_arrivals_exactly_once(engine: Engine) -> None:
    leases = SqlLeaseStore(engine)
    leader, token = ["a"], [leases.acquire("a", "a:1", ttl_s=60).token]
    a, b, c = (Replica(engine, n, leader, token) for n in "abc")
    rounds([a, b, c])  # the daemons have started
    answered = a.answer(range(1000, 1010)) + b.answer(range(2000, 2030))
    answered += c.answer(range(3000, 3005))
    rounds([a, b, c], 3)  # several rounds: nothing is taken in twice
    assert a.window() == sorted(answered)  # steady state: the leader plans on every arrival
    answered += a.answer(range(1010, 1015))  # the leader's last calls before it dies ...
    a.share.step()  # ... reach the database at its last round
    lost = a.answer(range(1015, 1017))  # answered after its last round: gone with it
    # a is SIGKILLed; b takes the lease
    leader[0], token[0] = "b", leases.acquire("b", "b:1", ttl_s=60).token
    answered += b.answer(range(2030, 2033)) + c.answer(range(3005, 3007))
    rounds([b, c], 3)
    assert b.window() == sorted(answered)  # the new leader: every arrival, each once
    assert not set(lost) & set(b.window())
    assert c.window() == b.window()  # a follower shows the same (GetTrafficMix on any replica)
    # a restarted process is a new replica with an empty window: it reads its former
    # self's rows like anyone else's, and counts its own calls once
    a2 = Replica(engine, "a2", leader, token)
    answered += a2.answer([4000])
    rounds([a2, b, c], 2)
    assert a2.window() == b.window() == c.window() == sorted(answered)
    # and the times are the times the calls were answered, not when they were read
    times = b.traffic.arrivals("m")[0]
    assert list(times) == sorted(times) and time.time() - times.min() < 60


class CommitsThenFails(SqlArrivalStore):
    """The connection drops after the database committed a publication, before it answered."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.fail_next = True
        self.wrote: list[bool] = []

    def publish(self, *args: Any, **kw: Any) -> bool:
        wrote = super().publish(*args, **kw)
        self.wrote.append(wrote)
        if self.fail_next:
            self.fail_next = False
            raise OperationalError("COMMIT", None, ConnectionError("connection lost"))
        return wrote


def test_a_publication_retried_after_its_commit_is_counted_once(engine: Engine) -> None:
    leader, token = ["b"], [SqlLeaseStore(engine).acquire("b", "b:1", ttl_s=60).token]
    store = CommitsThenFails(engine)
    a, b = Replica(engine, "a", leader, token, store), Replica(engine, "b", leader, token)
    answered = a.answer(range(100, 105))
    with pytest.raises(OperationalError):
        a.share.step()  # landed, but a does not know: it sends the same publication again
    answered += a.answer(range(105, 108))
    rounds([a, b], 2)
    assert b.window() == sorted(answered)
    assert store.wrote == [True, False, True]  # the copy was refused, the next one written
    assert a.share.published == 8


class AnswersWhilePublishing(SqlArrivalStore):
    """The real store; Route answers ``calls`` more on the replica while each publication is
    being written, as it does on a loaded replica."""

    def __init__(self, engine: Engine, calls: list[int]) -> None:
        super().__init__(engine)
        self.replica: Replica | None = None
        self.calls = calls
        self.rows: list[int] = []  # arrivals per publication written

    def publish(self, replica: str, batch: int, by_model: Any) -> bool:
        assert self.replica is not None
        if self.calls:
            self.replica.answer([self.calls.pop(0)])
        self.rows.append(sum(len(a) for a in by_model.values()))
        return super().publish(replica, batch, by_model)


def test_a_round_writes_one_publication_and_calls_answered_meanwhile_go_in_the_next(
    engine: Engine,
) -> None:
    """fs-17g: a round also published, at once, the calls answered while its publication was
    written: a second row and transaction nearly every round under load. Now they wait for the
    next round, and every replica still counts each call once."""
    leader, token = ["b"], [SqlLeaseStore(engine).acquire("b", "b:1", ttl_s=60).token]
    store = AnswersWhilePublishing(engine, [500, 501, 502])
    a, b = Replica(engine, "a", leader, token, store), Replica(engine, "b", leader, token)
    store.replica = a
    answered = a.answer(range(100, 110))
    a.share.step()
    assert store.rows == [10]  # one publication; 500 was answered while it was written
    a.share.step()
    assert store.rows == [10, 1]  # 500 now; 501 answered meanwhile, for the next round
    rounds([a, b], 2)
    assert store.rows == [10, 1, 1, 1]
    assert b.window() == sorted([*answered, 500, 501, 502])
    assert a.share.published == 13


def test_a_joining_replica_merges_only_what_its_window_can_keep(engine: Engine) -> None:
    """fs-17g: a first round reads back over the whole window; it merged every arrival, though
    the window keeps only its newest ``max_requests`` (600,000 merged to keep 50,000 at
    2,000 Route/s). Now rows wholly older than those are skipped, and the window is the same."""
    leader, token = ["a"], [SqlLeaseStore(engine).acquire("a", "a:1", ttl_s=60).token]
    a = Replica(engine, "a", leader, token)
    answered: list[int] = []
    for second in range(5):  # five publications of 30 calls, oldest first
        answered += a.answer(range(100 * second + 1, 100 * second + 31))
        a.share.step()
        time.sleep(0.01)  # each publication's calls strictly newer than the last's
    joiner = Replica(engine, "j", leader, token)
    joiner.traffic = TrafficMonitor(time.time, TrafficConfig(window_s=300, max_requests=50))
    joiner.share = TrafficShare(
        joiner.traffic, SqlArrivalStore(engine), "j", lambda: False, time.time
    )
    joiner.share.step()
    assert joiner.window() == sorted(answered[-50:])  # the newest 50, as merging all gives
    assert joiner.share.taken_in == 60  # the two newest publications; three never merged
    joiner.share.step()
    assert joiner.share.taken_in == 60  # and the skipped rows are not read again
