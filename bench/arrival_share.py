"""Cost of sharing Route arrivals between daemon replicas (issue 17, fs-17f).

Every replica publishes the Route calls it answered itself once a second (one row per model in
``route_arrivals``) and reads every other replica's new rows; the leader purges rows older than
the window every 30 rounds (``traffic_share.py``). This bench runs that code, unchanged
(``TrafficShare`` over ``SqlArrivalStore`` over a real database), for 1, 2 and 3 replicas in
one process, each replica with its own monitor, engine and sharing thread, while a feeder
spreads ``--rate`` Route observations a second over the replicas (as clients balancing on the
replica list would). Same-run baseline: one monitor fed the same rate with no sharing (a sole
daemon, which keeps no outbox and publishes nothing).

Per replica count and database it prints each sharing round's wall and CPU time (the thread's
own) and the database calls inside it (publish, read, purge), the feeder's CPU per second
against the baseline's, the rows and bytes in the table at the end, what a replica joining at
the end pays for its first round (it reads back over the whole window), and whether every
replica took in exactly what the others published. ``--growth-s`` then runs three replicas
with a short window (``--growth-window-s``) long enough for several purges and samples the
table's row count, to check it stays bounded.

PostgreSQL: each run creates its own database on the server of ``--pg-admin`` and drops it.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/arrival_share.py

``--before-src DIR`` runs every row twice, each in a process of its own: from the source tree
in DIR (``git archive main daemon common proto | tar -x -C DIR``) and from this one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select, text

sys.path.insert(0, str(Path(__file__).parent))
from pg_scratch import scratch_database

from fleetshift_daemon.core.traffic import TrafficConfig, TrafficMonitor
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.models import RouteArrivalRow
from fleetshift_daemon.store.traffic_store import SqlArrivalStore
from fleetshift_daemon.traffic_share import LOOKBACK_S, PURGE_EVERY, PURGE_MARGIN_S, TrafficShare

MODEL = "m"


class TimedStore(SqlArrivalStore):
    """The real store; each call's wall time recorded by name."""

    def __init__(self, engine: Engine, times: dict[str, list[float]]) -> None:
        super().__init__(engine)
        self.times = times

    def _timed(self, name: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.times.setdefault(name, []).append(time.perf_counter() - start)

    def publish(self, replica: str, batch: int, by_model: Any) -> bool:
        return bool(
            self._timed(
                "publish", lambda: super(TimedStore, self).publish(replica, batch, by_model)
            )
        )

    def since(self, other_than: str, max_age_s: float, skip: Any = ()) -> Any:
        return self._timed(
            "read", lambda: super(TimedStore, self).since(other_than, max_age_s, skip)
        )

    def purge(self, older_than_s: float) -> int:
        return int(self._timed("purge", lambda: super(TimedStore, self).purge(older_than_s)))


@dataclass
class Replica:
    name: str
    monitor: TrafficMonitor
    share: TrafficShare
    engine: Engine
    times: dict[str, list[float]] = field(default_factory=dict)  # store calls, s
    rounds: list[tuple[float, float]] = field(default_factory=list)  # (wall, cpu) per round, s


def make_replica(url: str, index: int, window_s: float) -> Replica:
    monitor = TrafficMonitor(time.monotonic, TrafficConfig(window_s=window_s))
    engine = make_engine(url)
    times: dict[str, list[float]] = {}
    leader = index == 0
    share = TrafficShare(
        monitor, TimedStore(engine, times), f"replica-{index}-{uuid.uuid4().hex[:6]}",
        lambda: leader, time.monotonic,
    )  # fmt: skip
    return Replica(share._identity, monitor, share, engine, times)


def sharing_loop(replica: Replica, stop: threading.Event, interval_s: float) -> None:
    """What ``TrafficShare.run`` does, on a thread, with each round timed."""
    while not stop.wait(interval_s):
        wall, cpu = time.perf_counter(), time.thread_time()
        replica.share.step()
        replica.rounds.append((time.perf_counter() - wall, time.thread_time() - cpu))


def feed(monitors: list[TrafficMonitor], rate: float, seconds: float) -> float:
    """``rate`` observations a second spread evenly over ``monitors`` in 10 ms ticks; returns
    the feeder's CPU seconds per second of run."""
    tick, per_tick = 0.01, rate * 0.01
    owed, cpu0, start = 0.0, time.thread_time(), time.monotonic()
    i = 0
    while (now := time.monotonic()) - start < seconds:
        owed += per_tick
        while owed >= 1:
            monitors[i % len(monitors)].observe_request(MODEL, 200 + i % 1000, 100.0)
            i += 1
            owed -= 1
        time.sleep(max(0.0, start + tick * (1 + round((now - start) / tick)) - time.monotonic()))
    return (time.thread_time() - cpu0) / seconds


def table_state(engine: Engine) -> tuple[int, int]:
    """(rows, bytes) of route_arrivals."""
    with engine.connect() as conn:
        rows = int(conn.execute(select(func.count()).select_from(RouteArrivalRow)).scalar_one())
        if engine.dialect.name == "postgresql":
            size = conn.execute(text("SELECT pg_total_relation_size('route_arrivals')")).scalar()
        else:
            size = Path(str(engine.url.database)).stat().st_size
    return rows, int(size or 0)


@contextmanager
def database(kind: str, pg_admin: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite:///{tmp}/bench.db"
        return
    with scratch_database("bench_arrivals", pg_admin) as url:
        yield url


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> str:
    return (
        f"{1e3 * statistics.median(values):.2f} / {1e3 * pct(values, 0.99):.2f}" if values else "-"
    )


def run(
    kind: str, url: str, count: int, rate: float, seconds: float, window_s: float, label: str = ""
) -> None:
    upgrade(make_engine(url, pool=1))
    replicas = [make_replica(url, i, window_s) for i in range(count)]
    stop = threading.Event()
    threads = [threading.Thread(target=sharing_loop, args=(r, stop, 1.0)) for r in replicas]
    for t in threads:
        t.start()
    feeder_cpu = feed([r.monitor for r in replicas], rate, seconds)
    stop.set()
    for t in threads:
        t.join()
    for r in replicas:
        r.share.flush()  # as a graceful stop does: what is left is published
    for r in replicas:
        r.share.step()  # and every replica takes in the last publications
    rows, size = table_state(replicas[0].engine)
    batches = sum(r.share._batch for r in replicas)  # publications (one row each: one model)
    joiner = make_replica(url, count, window_s)
    wall, cpu = time.perf_counter(), time.thread_time()
    joiner.share.step()
    join_wall, join_cpu = time.perf_counter() - wall, time.thread_time() - cpu
    published = sum(r.share.published for r in replicas)
    exact = all(r.share.taken_in == published - r.share.published for r in replicas)
    walls = [w for r in replicas for w, _ in r.rounds]
    cpus = [c for r in replicas for _, c in r.rounds]
    calls = {
        name: [t for r in replicas for t in r.times.get(name, [])]
        for name in ("publish", "read", "purge")
    }
    per_window = 30 * statistics.mean(walls) if walls else 0.0
    print(
        f"| {label} | {kind} | {count} | {len(walls)} | {batches / max(1, len(walls)):.2f} | {ms(walls)} | {1e3 * statistics.mean(cpus):.2f} | "
        f"{1e3 * per_window:.0f} | {ms(calls['publish'])} | {ms(calls['read'])} | "
        f"{ms(calls['purge'])} | {1e3 * feeder_cpu:.1f} | {rows} / {size >> 10} KiB | "
        f"{joiner.share.taken_in:,} in {1e3 * join_wall:.0f} ms ({1e3 * join_cpu:.0f} CPU) | "
        f"{'yes' if exact else 'NO'} |",
        flush=True,
    )
    for r in [*replicas, joiner]:
        r.engine.dispose()


def baseline(rate: float, seconds: float, window_s: float) -> None:
    monitor = TrafficMonitor(time.monotonic, TrafficConfig(window_s=window_s))
    cpu = feed([monitor], rate, seconds)
    print(
        f"| | baseline (no sharing) | 1 | - | - | - | - | - | - | - | - | {1e3 * cpu:.1f} | - | - | - |",
        flush=True,
    )


def growth(kind: str, url: str, rate: float, seconds: float, window_s: float) -> None:
    """Three replicas, a short window: the row count over time, against the purge's bound."""
    upgrade(make_engine(url, pool=1))
    replicas = [make_replica(url, i, window_s) for i in range(3)]
    stop = threading.Event()
    threads = [threading.Thread(target=sharing_loop, args=(r, stop, 1.0)) for r in replicas]
    for t in threads:
        t.start()
    samples: list[tuple[float, int]] = []
    sampler_stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not sampler_stop.wait(5.0):
            samples.append((time.monotonic() - start, table_state(replicas[0].engine)[0]))

    sampler = threading.Thread(target=sample)
    sampler.start()
    feed([r.monitor for r in replicas], rate, seconds)
    sampler_stop.set()
    sampler.join()
    stop.set()
    for t in threads:
        t.join()
    purged = len(replicas[0].times.get("purge", []))
    bound = 3 * (window_s + PURGE_MARGIN_S + PURGE_EVERY + 2)  # rows: 3 replicas x 1 model
    print(
        f"\n{kind}, 3 replicas, window {window_s:.0f} s, {seconds:.0f} s, {purged} purges; "
        f"bound 3 x (window + {PURGE_MARGIN_S:.0f} s margin + {PURGE_EVERY} rounds + 2) = {bound:.0f} rows"
    )
    print("rows over time (s: rows): " + ", ".join(f"{t:.0f}: {n}" for t, n in samples), flush=True)
    for r in replicas:
        r.engine.dispose()


def full_join(kind: str, url: str, rate: float, window_s: float) -> None:
    """A replica joining when the table holds a whole window of the others' arrivals (``rate``
    a second for ``window_s``, one row a second as publications are): its first round reads
    back over the whole window. The rows are published now with ages spread over the window,
    so the read and the merge are what they would be after ``window_s`` of traffic."""
    upgrade(make_engine(url, pool=1))
    engine = make_engine(url)
    store = SqlArrivalStore(engine)
    per_row = int(rate)
    for second in range(int(window_s)):
        arrivals = [(second + k / per_row, 200 + k % 1000, 100.0) for k in range(per_row)]
        store.publish(f"other-{second % 2}", second, {MODEL: arrivals})
    rows, size = table_state(engine)
    joiner = make_replica(url, 9, window_s)
    wall, cpu = time.perf_counter(), time.thread_time()
    joiner.share.step()
    took, took_cpu = time.perf_counter() - wall, time.thread_time() - cpu
    read = joiner.times.get("read", [0.0])[0]
    kept = joiner.monitor.stats(MODEL).requests
    print(
        f"\n{kind}: a replica joining with {rows} rows / {size >> 10} KiB in the table "
        f"({window_s:.0f} s at {rate:.0f}/s): first round {1e3 * took:.0f} ms wall, "
        f"{1e3 * took_cpu:.0f} ms CPU, of which the read {1e3 * read:.0f} ms; took in "
        f"{joiner.share.taken_in:,}, its window keeps {kept:,}",
        flush=True,
    )
    joiner.engine.dispose()
    engine.dispose()


def source_env(src: str) -> dict[str, str] | None:
    """The environment of a row run from the source tree ``src`` (``git archive main daemon
    common proto | tar -x -C DIR``; "": this one)."""
    if not src:
        return None
    root = Path(src).resolve()
    paths = [str(root / d) for d in ("daemon", "common", "proto")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--db", nargs="+", default=["postgresql", "sqlite"], choices=["postgresql", "sqlite"]
    )
    p.add_argument("--replicas", default="1,2,3")
    p.add_argument("--rate", type=float, default=2000.0, help="Route calls/s over all replicas")
    p.add_argument("--seconds", type=float, default=30.0, help="per replica count")
    p.add_argument("--window-s", type=float, default=TrafficConfig().window_s)
    p.add_argument("--growth-s", type=float, default=150.0, help="0: skip the growth run")
    p.add_argument("--growth-window-s", type=float, default=20.0)
    p.add_argument("--growth-only", action="store_true", help="only the growth run")
    p.add_argument(
        "--pg-admin",
        default=os.environ.get("FLEETSHIFT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    p.add_argument("--before-src", default="", help="also run each row from this source tree")
    p.add_argument("--row", default="", help=argparse.SUPPRESS)  # DB:COUNT, one row, no header
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        kind, count = args.row.split(":")
        with database(kind, args.pg_admin) as url:
            run(kind, url, int(count), args.rate, args.seconds, args.window_s, args.label)
        return
    with open("/proc/loadavg") as f:
        print(
            f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {f.read().split()[:3]}, "
            f"{args.rate:.0f} Route/s, {args.seconds:.0f} s per row, window {args.window_s:.0f} s, "
            f"sharing every 1 s, lookback {LOOKBACK_S:.0f} s; times: median / p99 ms\n"
        )
    print(
        "| code | db | replicas | rounds | publications a round | round wall ms | round CPU ms (mean) | wall per 30 s planning interval, ms | "
        "publish ms | read ms | purge ms | feeder CPU ms/s | rows / size at end | joiner's first round | "
        "each took in exactly the others' |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    if args.growth_only:
        args.replicas = ""
    else:
        baseline(args.rate, args.seconds, args.window_s)
    for kind in args.db:
        for count in (int(c) for c in args.replicas.split(",") if c):
            if args.before_src:  # each row in a process of its own: before, then after
                for label, src in (("before", args.before_src), ("after", "")):
                    cmd = [sys.executable, __file__, "--row", f"{kind}:{count}", "--label", label]
                    cmd += ["--rate", str(args.rate), "--seconds", str(args.seconds)]
                    cmd += ["--window-s", str(args.window_s), "--pg-admin", args.pg_admin]
                    subprocess.run(cmd, env=source_env(src), check=True)
                continue
            with database(kind, args.pg_admin) as url:
                run(kind, url, count, args.rate, args.seconds, args.window_s, "this tree")
    for kind in args.db if not args.growth_only else ():
        with database(kind, args.pg_admin) as url:
            full_join(kind, url, args.rate, args.window_s)
    if args.growth_s > 0:
        for kind in args.db:
            with database(kind, args.pg_admin) as url:
                growth(kind, url, args.rate, args.growth_s, args.growth_window_s)
    with open("/proc/loadavg") as f:
        print(
            f"\n# end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {f.read().split()[:3]}"
        )


if __name__ == "__main__":
    main()
