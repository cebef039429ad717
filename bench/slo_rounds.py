"""Rounds and samples the SLO monitor keeps when heartbeats arrive one node at a time.

The daemon receives each node's heartbeat at its own clock reading. Before fs-11m the monitor
opened a round per clock reading, so it kept a round per heartbeat (39,100 rounds after 60 s
at 1,000 nodes in fs-17g's load bench), and every full GC pass walked them. This feeds the
pure monitor ``--nodes`` nodes of ``--workers`` workers each, heartbeating once every
``--interval`` s with the nodes spread evenly over the interval, for ``--seconds`` simulated
seconds, and prints rounds and samples kept, the GC-tracked objects the monitor holds, the
time of a full collection, and the time of
one ``assess`` (it walks every round). Same-run baseline: ``round_s`` near 0 opens a round at every clock reading,
which is the old rule; the second row is the monitor as the daemon now configures it
(``round_s`` = the heartbeat interval).

    PYTHONPATH=daemon:common nice -n 10 .venv/bin/python bench/slo_rounds.py
"""

from __future__ import annotations

import argparse
import gc
import time

from fleetshift_daemon.core.slo_monitor import (
    LatencySample,
    SloMonitor,
    SloMonitorConfig,
    SloThresholds,
)


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


def feed(nodes: int, workers: int, interval: float, seconds: float, round_s: float) -> None:
    gc.collect()
    tracked_before = len(gc.get_objects())
    clock = Clock()
    mon = SloMonitor(clock, SloMonitorConfig(round_s=round_s))
    start = time.perf_counter()
    for k in range(int(seconds / interval)):
        for n in range(nodes):
            clock.t = (k + n / nodes) * interval
            mon.observe(
                LatencySample(f"n{n}-w{w}", "m", 200.0, 600.0, 20.0, 60.0, n % 5, 8)
                for w in range(workers)
            )
    observe_s = time.perf_counter() - start
    states = mon._models.values()  # what memory holds: read inside, this is a bench
    rounds = sum(len(s.rounds) for s in states)
    samples = sum(len(r.samples) for s in states for r in s.rounds)
    gc.collect()
    tracked = len(gc.get_objects()) - tracked_before
    gc_ms = full_gc_ms()
    start = time.perf_counter()
    mon.assess("m", SloThresholds(1000.0, 100.0))
    assess_ms = 1e3 * (time.perf_counter() - start)
    print(
        f"round_s={round_s:<6g} rounds={rounds:>6} samples={samples:>6} "
        f"gc-tracked objects kept={tracked:>6}  observe total={observe_s:5.2f} s  "
        f"full gc (min of 5)={gc_ms:6.1f} ms  assess={assess_ms:7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    print(
        f"{args.nodes} nodes x {args.workers} workers, a heartbeat every {args.interval:g} s "
        f"per node (staggered), {args.seconds:g} s"
    )
    for round_s in (1e-6, args.interval):  # baseline (a round per clock reading), then now
        feed(args.nodes, args.workers, args.interval, args.seconds, round_s)
        gc.collect()


if __name__ == "__main__":
    main()
