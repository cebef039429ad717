"""What an unbounded operations table costs a follower: one full re-read, at history sizes.

A follower re-reads the operations table whenever the leader wrote it and at least every
``replicas.view_full_read_s`` (10 s until 2026-12-05, 300 s since), and a (re)starting daemon
reads it whole. Before
``history_retention_s`` nothing left it: the read grew with every operation the fleet ever
ran. This times ``SqlOperationStore.load_operations`` (the read both do) on a fresh
PostgreSQL database holding N finished operations of two move steps each, for each N given;
the baseline is the same read of an empty table, in the same run.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/history_reads.py
    PYTHONPATH=. nice -n 10 .venv/bin/python bench/history_reads.py --sizes 0 1000 20000 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pg_scratch import scratch_database

from fleetshift_daemon.core.operations import (
    Operation,
    OperationKind,
    OperationState,
    Step,
    StepKind,
    StepState,
)
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.work_store import SqlOperationStore


def operation(i: int) -> Operation:
    steps = tuple(
        Step(
            index=k,
            kind=StepKind.MIGRATE,
            worker_id=f"w-{i}-{k}",
            target_node=f"h200-{k}",
            state=StepState.DONE,
            new_worker_id=f"w-{i}-{k}-new",
            snapshot_id=f"snap-{i}-{k}",
            bytes_moved=140_000_000_000,
            sessions_carried=12,
        )
        for k in range(2)
    )
    return Operation(
        id=f"op-{i:08d}",
        kind=OperationKind.REBALANCE,
        state=OperationState.SUCCEEDED,
        requested_by="planner",
        reason="the mix moved: prefill share 0.31 -> 0.44",
        created_at=1.7e9 + i,
        updated_at=1.7e9 + i + 60,
        steps=steps,
    )


def timed_reads(store: SqlOperationStore, repeat: int) -> tuple[float, int]:
    times, count = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        count = len(store.load_operations())
        times.append(time.perf_counter() - start)
    return statistics.median(times), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 1000, 10000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with scratch_database() as url:
        engine = make_engine(url)
        upgrade(engine)
        store = SqlOperationStore(engine)
        written = 0
        print(f"{'operations':>10} {'full read ms (median)':>22} {'ms per 1,000 ops':>17}")
        for size in sorted(args.sizes):
            for i in range(written, size):
                store.save_operation(operation(i))
            written = max(written, size)
            seconds, count = timed_reads(store, args.repeat)
            per_k = seconds * 1e6 / count if count else float("nan")
            print(f"{count:>10,} {seconds * 1e3:>22.1f} {per_k:>17.1f}")
        engine.dispose()


if __name__ == "__main__":
    main()
