"""What a follower spends re-reading its view while the leader's executor writes operations.

Two daemons (leader and follower) in this process on one fresh PostgreSQL database, the
synthetic fleet of ``bench/failover.py`` (``--nodes`` nodes of 8 H100s, two workers each)
registered with both through the real agent protocol. The leader then rewrites one
operation every ``--write-every`` seconds for ``--seconds`` (as an executor's steps do during
a move), and the follower's re-reads are counted and timed per view (the thread CPU time of
each ``refresh``). Modes, one after the other on the same daemons:

- ``any-change`` (the baseline: the rule before 2026-12-05): any change of the mark re-reads
  every view;
- ``per-table`` (this tree): only the views whose tables changed.

Both re-read everything at least every ``replicas.view_full_read_s`` (the daemon's default,
300 s since 2026-12-05; 10 s, fixed, before), so a 30 s mode sees at most the first full read.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/follower_reads.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from failover import Agents, _free_port, daemon_config
from pg_scratch import scratch_database

from fleetshift_common.config import daemon_config as load_config
from fleetshift_daemon import app as app_module
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.operations import OperationKind
from fleetshift_daemon.store.view_mark import VIEWS, stale_views


def any_change(before: Any, now: Any) -> frozenset[str]:
    return VIEWS if before is None or now is None or before != now else frozenset()


RULES = {"any-change": any_change, "per-table": stale_views}


def timed(
    cpu: collections.Counter[str], calls: collections.Counter[str], name: str, fn: Any
) -> Any:
    def refresh() -> Any:
        start = time.thread_time()
        try:
            return fn()
        finally:
            cpu[name] += time.thread_time() - start
            calls[name] += 1

    return refresh


async def measure(leader: Daemon, follower: Daemon, seconds: float, every: float) -> dict[str, Any]:
    assert leader.operations is not None
    cpu: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    originals = {}
    for name in ("registry", "workers", "operations"):
        view = getattr(follower, name)
        originals[name] = view.refresh
        view.refresh = timed(cpu, calls, name, view.refresh)
    op, _ = await asyncio.to_thread(
        leader.operations.create, OperationKind.REBALANCE, "bench", "steps", ()
    )
    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        n += 1
        await asyncio.to_thread(leader.operations.update, op.id, summary={"step": n})
        await asyncio.sleep(every)
    for name, fn in originals.items():
        getattr(follower, name).refresh = fn
    return {"writes": n, "cpu": dict(cpu), "calls": dict(calls)}


async def run(args: argparse.Namespace, url: str, tmp: Path) -> None:
    daemons = []
    for i in range(2):
        path = daemon_config(tmp, f"d{i}", _free_port(), url)
        daemons.append(Daemon(load_config(path)))
    await daemons[0].start()
    while not (daemons[0].leadership and daemons[0].leadership.acting()):
        await asyncio.sleep(0.05)
    await daemons[1].start()
    leader, follower = daemons
    try:
        agents = Agents([f"127.0.0.1:{d.port}" for d in daemons], args.nodes)
        start = time.monotonic()
        await agents.register()
        print(
            f"registered {args.nodes} nodes with both daemons in {time.monotonic() - start:.1f} s"
        )
        await asyncio.sleep(2.0)
        rows = []
        for mode, rule in RULES.items():
            app_module.stale_views = rule  # type: ignore[attr-defined]
            rows.append((mode, await measure(leader, follower, args.seconds, args.write_every)))
        app_module.stale_views = stale_views  # type: ignore[attr-defined]
    finally:
        for d in (follower, leader):
            await d.stop(0.1)
    print(
        f"\nload average at end {os.getloadavg()[0]:.1f}; {args.nodes} nodes; "
        f"an operation rewritten every {args.write_every} s for {args.seconds} s per mode"
    )
    print(
        "| rule | operation writes | follower re-reads (registry / workers / operations) "
        "| follower CPU in re-reads s (registry / workers / operations) | CPU s per write |"
    )
    print("|---|---|---|---|---|")
    for mode, r in rows:
        c, k = r["cpu"], r["calls"]
        total = sum(c.values())
        print(f"| {mode} | {r['writes']} | {k.get('registry', 0)} / {k.get('workers', 0)} / "
              f"{k.get('operations', 0)} | {c.get('registry', 0):.2f} / {c.get('workers', 0):.2f} / "
              f"{c.get('operations', 0):.2f} | {total / r['writes']:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--write-every", type=float, default=0.5)
    args = parser.parse_args()
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args, url, Path(tmp)))


if __name__ == "__main__":
    main()
