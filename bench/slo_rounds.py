"""Rounds and samples the SLO monitor keeps when heartbeats arrive one node at a time.

The daemon receives each node's heartbeat at its own clock reading. Before fs-11m the monitor
opened a round per clock reading, so it kept a round per heartbeat (39,100 rounds after 60 s
at 1,000 nodes in fs-17g's load bench), and every full GC pass walked them. This feeds the
pure monitor ``--nodes`` nodes of ``--workers`` workers each, heartbeating once every
``--interval`` s with the nodes spread evenly over the interval, for ``--seconds`` simulated
seconds, and prints rounds and samples kept, the GC-tracked objects the monitor holds, the
time of a full collection, and the time of
one ``assess`` (it walks every round; then a second one, which since fs-17h reuses the scores
of rounds no report joins any more). Same-run baseline: ``round_s`` near 0 opens a round at
every clock reading, which is the old rule; the second row is the monitor as the daemon now
configures it (``round_s`` = the heartbeat interval).

``--before-src DIR`` (fs-17h) adds, first, the monitor of another source tree at the daemon's
``round_s`` (``git archive <commit> daemon common | tar -x -C DIR``; its module is loaded from
the file, beside this tree's): the same-run baseline for keeping reports as rows.

    PYTHONPATH=daemon:common nice -n 10 .venv/bin/python bench/slo_rounds.py
    PYTHONPATH=daemon:common nice -n 10 .venv/bin/python bench/slo_rounds.py --seconds 300 \
        --before-src /tmp/base
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import fleetshift_daemon.core.slo_monitor as this_tree


def load_from(src: str) -> ModuleType:
    """The SLO monitor module of another source tree, loaded beside this tree's."""
    path = Path(src) / "daemon/fleetshift_daemon/core/slo_monitor.py"
    spec = importlib.util.spec_from_file_location("slo_monitor_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def held(r: Any) -> int:
    """Reports a round holds: a dict of samples before fs-17h, rows since."""
    return len(r.samples) if hasattr(r, "samples") else len(r)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def full_gc_ms(repeat: int = 5) -> float:
    """The fastest of ``repeat`` full collections (the machine is shared: the minimum is the
    cost of the walk, the rest is other load)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def feed(
    m: ModuleType,
    label: str,
    nodes: int,
    workers: int,
    interval: float,
    seconds: float,
    round_s: float,
) -> None:
    gc.collect()
    tracked_before = len(gc.get_objects())
    clock = Clock()
    mon = m.SloMonitor(clock, m.SloMonitorConfig(round_s=round_s))
    start = time.perf_counter()
    for k in range(int(seconds / interval)):
        for n in range(nodes):
            clock.t = (k + n / nodes) * interval
            mon.observe(
                m.LatencySample(f"n{n}-w{w}", "m", 200.0, 600.0, 20.0, 60.0, n % 5, 8)
                for w in range(workers)
            )
    observe_s = time.perf_counter() - start
    states = mon._models.values()  # what memory holds: read inside, this is a bench
    rounds = sum(len(s.rounds) for s in states)
    samples = sum(held(r) for s in states for r in s.rounds)
    gc.collect()
    tracked = len(gc.get_objects()) - tracked_before
    gc_ms = full_gc_ms()
    assess_ms = []
    for _ in range(2):
        start = time.perf_counter()
        mon.assess("m", m.SloThresholds(1000.0, 100.0))
        assess_ms.append(1e3 * (time.perf_counter() - start))
    print(
        f"{label:<20} round_s={round_s:<6g} rounds={rounds:>6} samples={samples:>6} "
        f"gc-tracked objects kept={tracked:>6}  observe total={observe_s:5.2f} s  "
        f"full gc (min of 5)={gc_ms:6.1f} ms  assess={assess_ms[0]:7.1f} ms, "
        f"again {assess_ms[1]:7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--before-src", default="", help="first, the monitor of this tree")
    parser.add_argument("--no-round-baseline", action="store_true", help="skip round_s near 0")
    args = parser.parse_args()
    print(
        f"{args.nodes} nodes x {args.workers} workers, a heartbeat every {args.interval:g} s "
        f"per node (staggered), {args.seconds:g} s"
    )
    with open("/proc/loadavg") as f:
        print(f"# {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {f.read().split()[:3]}")
    rows: list[tuple[ModuleType, str, float]] = []
    if args.before_src:
        rows.append((load_from(args.before_src), "before-src", args.interval))
    if not args.no_round_baseline:  # a round per clock reading (before fs-11m)
        rows.append((this_tree, "this tree", 1e-6))
    rows.append((this_tree, "this tree", args.interval))
    for m, label, round_s in rows:
        feed(m, label, args.nodes, args.workers, args.interval, args.seconds, round_s)
        gc.collect()
    with open("/proc/loadavg") as f:
        print(f"# {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {f.read().split()[:3]}")


if __name__ == "__main__":
    main()
