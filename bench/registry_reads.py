"""What a follower's registry re-read costs: every node and its GPUs, read from PostgreSQL.

A follower re-reads the registry whenever a node or GPU row changed (a registration, a node
lost or back, a cordon) and at each full read (``replicas.view_full_read_s``), and a starting
daemon reads it whole. This times ``SqlRegistryStore.load_nodes`` on a fresh database holding
N nodes of 8 GPUs each, wall time and this thread's CPU time (the read holds the GIL for most
of it, beside the Route calls a follower serves). Baseline, same run, same database: the read
as it was before 2026-12-05, through the ORM (``select(NodeRow)`` with ``selectinload`` of
the GPUs), converted to the same records.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/registry_reads.py
    PYTHONPATH=. nice -n 10 .venv/bin/python bench/registry_reads.py --sizes 100 1000 --repeat 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pg_scratch import scratch_database
from sqlalchemy import select
from sqlalchemy.orm import selectinload, sessionmaker

from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeRecord,
    NodeState,
    NodeVersions,
)
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.models import NodeRow
from fleetshift_daemon.store.registry_store import SqlRegistryStore, _record


def node(i: int) -> NodeRecord:
    gpus = tuple(
        GpuInfo(k, "NVIDIA H100 80GB HBM3", 80 << 30, "hbm3", "9.0", True, (0, 1, 2, 3), f"u{k}")
        for k in range(8)
    )
    return NodeRecord(
        f"node-{i:05d}", f"10.0.{i // 250}.{i % 250}:50052", NodeState.READY,
        InventorySource.DECLARED, NodeVersions("550.54", "12.4", "2.4.0", "0.1.0"), gpus,
        registered_at=1.7e9, last_heartbeat_at=1.7e9 + i,
    )  # fmt: skip


def orm_read(store: SqlRegistryStore) -> list[NodeRecord]:
    """The read before 2026-12-05 (the baseline)."""
    sessions: sessionmaker = store._sessions  # type: ignore[type-arg]
    with sessions() as session:
        rows = session.scalars(select(NodeRow).options(selectinload(NodeRow.gpus))).all()
        return [_record(row, row.gpus) for row in rows]


def timed(read: Callable[[], list[NodeRecord]], repeat: int) -> tuple[float, float, int]:
    """Median wall and thread-CPU seconds of ``repeat`` reads, and the nodes read."""
    walls, cpus, count = [], [], 0
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.thread_time()
        count = len(read())
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(walls), statistics.median(cpus), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with scratch_database() as url:
        engine = make_engine(url)
        upgrade(engine)
        store = SqlRegistryStore(engine)
        written = 0
        print("| nodes (8 GPUs each) | read | wall ms (median) | CPU ms (median) |")
        print("|---|---|---|---|")
        for size in sorted(args.sizes):
            for i in range(written, size):
                store.save_node(node(i))
            written = max(written, size)
            assert sorted(orm_read(store), key=lambda n: n.name) == store.load_nodes()
            for name, read in (("ORM (before)", lambda: orm_read(store)),
                               ("plain rows (this tree)", store.load_nodes)):  # fmt: skip
                wall, cpu, count = timed(read, args.repeat)
                print(f"| {count:,} | {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} |")
        engine.dispose()


if __name__ == "__main__":
    main()
