"""Cut the leader's link: two daemon replicas, each in a network namespace of its own, reach
PostgreSQL only across the lab's bridge (a relay in a "database host" namespace). The
leader's link is taken down (``ip link set eth0 down`` in its namespace). Then:

- it stops acting (its log says so) before its lease could have expired: the expiry is the
  database's, read from the lease row while the leader still renewed it;
- the other replica takes the lease, with the token one higher;
- with the link back, a write carrying the old leader's token, sent from the old leader's
  namespace, is refused by the database, and the table it aimed at is unchanged; the old
  leader stays a follower.

Needs root and iproute2 (skipped without them on a developer machine, failed under CI=true)
and the local PostgreSQL's unix socket.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from fleetshift_daemon.store.database import make_engine
from fleetshift_daemon.store.models import LeaderLeaseRow, WorkerRow
from tests.ci import needs
from tests.multihost.netns import Host, Lab, netns_supported

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SUPPORTED, MISSING = netns_supported()
PG_SOCKET = "/var/run/postgresql/.s.PGSQL.5432"
REPO = Path(__file__).resolve().parents[2]
TTL_S, RENEW_S, DEADLINE_S = 3.0, 0.5, 2.0
DB_PORT = 5432

STALE_WRITE = """
import json, sys
from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec
from fleetshift_daemon.store.database import make_engine
from fleetshift_daemon.store.work_store import SqlWorkerStore
url, token = sys.argv[1], int(sys.argv[2])
store = SqlWorkerStore(make_engine(url), fence=lambda: token)
worker = WorkerRecord("w-stale", "n1", WorkerSpec("m", Role.MIXED), (0,), "x:1",
                      WorkerState.SERVING, 1.0)
try:
    store.save_worker(worker)
    print(json.dumps({"refused": False}))
except Deposed as err:
    print(json.dumps({"refused": True, "error": str(err)}))
"""


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@dataclass
class LeaseWatch:
    """The lease row every 20 ms from the machine's own namespace (the test's view)."""

    url: str
    seen: list[tuple[float, str, int, datetime]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        engine = make_engine(self.url)
        while not self.stop.is_set():
            with engine.connect() as conn:
                row = conn.execute(
                    select(LeaderLeaseRow.address, LeaderLeaseRow.token, LeaderLeaseRow.expires_at)
                ).one()
            self.seen.append((time.time(), row.address, int(row.token), row.expires_at))
            time.sleep(0.02)
        engine.dispose()

    def now(self) -> tuple[str, int]:
        while not self.seen:
            time.sleep(0.02)
        _, address, token, _ = self.seen[-1]
        return address, token

    def wait(self, check, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not check(*self.now()):
            assert time.monotonic() < deadline, f"lease never became what was awaited: {self.now()}"
            time.sleep(0.02)


@pytest.fixture
def watched(pg_url: str) -> Iterator[LeaseWatch]:
    from fleetshift_daemon.store.database import upgrade

    upgrade(make_engine(pg_url))  # the lease row exists before anyone watches it
    watch = LeaseWatch(pg_url)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    yield watch
    watch.stop.set()
    thread.join(timeout=10)


def _daemon(lab: Lab, host: Host, root: Path, url: str) -> None:
    cfg = root / f"{host.label}.toml"
    cfg.write_text(
        # loopback inside its own namespace: the gRPC port plays no part here, the database
        # link does (plaintext is allowed on loopback)
        f'listen = "127.0.0.1:50051"\nstate_dir = "{root / host.label}"\n'
        f'database_url = "{url}"\nliveness_check_interval_s = 0.5\n'
        f"[replicas]\nadvertise_address = \"{host.address}:50051\"\nlease_ttl_s = {TTL_S}\n"
        f"renew_interval_s = {RENEW_S}\nrenew_deadline_s = {DEADLINE_S}\nview_refresh_s = 0.2\n"
    )  # fmt: skip
    argv = [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(cfg)]
    lab.popen(host, argv, root / f"{host.label}.log", _env())


def _wait_ready(log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and "daemon ready" in log.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{log.name}: the daemon did not start"
        time.sleep(0.1)


def _deposed_at(log: Path) -> float | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and "leadership: deposed" in line:
            return float(json.loads(line)["ts"])
    return None


@needs(SUPPORTED, MISSING)
def test_a_leader_cut_off_stops_before_its_lease_expires_and_its_token_is_refused(
    tmp_path: Path, pg_url: str, watched: LeaseWatch
) -> None:
    assert Path(PG_SOCKET).exists(), f"PostgreSQL's unix socket {PG_SOCKET} is needed"
    with Lab() as lab:
        db, a, b = lab.add_host("db", 5), lab.add_host("rep-a", 21), lab.add_host("rep-b", 22)
        relay = [sys.executable, "-m", "tests.multihost.pg_relay", f"{db.address}:{DB_PORT}"]
        lab.popen(db, [*relay, PG_SOCKET], tmp_path / "relay.log", _env())
        url = pg_url.replace("127.0.0.1:5432", f"{db.address}:{DB_PORT}")
        _daemon(lab, a, tmp_path, url)
        watched.wait(lambda address, token: address.startswith(a.address), 120)
        _daemon(lab, b, tmp_path, url)
        _wait_ready(tmp_path / "rep-b.log")  # b follows: it cannot take an unexpired lease
        _, old_token = watched.now()

        cut_at = time.time()
        lab.run(a, ["ip", "link", "set", "eth0", "down"], timeout_s=10).check_returncode()
        watched.wait(lambda address, token: token == old_token + 1, TTL_S + 30)
        # The old lease's expiry: the last one the database gave it (it renewed until the cut).
        expiry = max(e for _, _, t, e in watched.seen if t == old_token).timestamp()
        deposed = _deposed_at(tmp_path / "rep-a.log")
        assert deposed is not None, "the cut-off leader never stopped acting"
        print(
            f"\ncut at 0; leader stopped acting at {deposed - cut_at:.2f}s; its lease expired at "
            f"{expiry - cut_at:.2f}s; taken over (token {old_token + 1}) by {watched.now()[0]}"
        )
        assert cut_at < deposed < expiry, (cut_at, deposed, expiry)
        assert watched.now()[0].startswith(b.address)

        lab.run(a, ["ip", "link", "set", "eth0", "up"], timeout_s=10).check_returncode()
        argv = [sys.executable, "-c", STALE_WRITE, url, str(old_token)]
        done = lab.run(a, argv, timeout_s=120, env=_env())
        assert done.returncode == 0, done.stderr[-3000:]
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        assert answer["refused"], answer
        assert f"fencing token {old_token} is stale" in answer["error"]
        with make_engine(pg_url).connect() as conn:
            assert conn.execute(select(WorkerRow.id)).all() == []
        time.sleep(3 * RENEW_S + TTL_S)  # the old leader, reconnected, stays a follower
        assert watched.now() == (f"{b.address}:50051", old_token + 1)
