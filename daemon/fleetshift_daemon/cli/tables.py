"""Rendering of API answers as terminal tables (rich), separate from talking to the daemon."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from rich.table import Table

from fleetshift.v1 import fleet_pb2 as pb

GiB = 1024**3

STATE_TEXT = {
    pb.NODE_STATE_READY: "[green]ready[/]",
    pb.NODE_STATE_LOST: "[red]lost[/]",
    pb.NODE_STATE_UNSPECIFIED: "?",
}


def gpu_summary(node: pb.Node) -> str:
    counts = Counter(g.product_name for g in node.gpus)
    return ", ".join(f"{n}x {name}" for name, n in sorted(counts.items()))


def _age(node: pb.Node, now: float) -> str:
    if not node.HasField("last_heartbeat_at"):
        return "never"
    seconds = now - node.last_heartbeat_at.ToNanoseconds() / 1e9
    return f"{max(seconds, 0):.1f}s ago"


def nodes_table(nodes: Sequence[pb.Node], now: float | None = None) -> Table:
    now = time.time() if now is None else now
    table = Table(title=f"FleetShift fleet: {len(nodes)} nodes")
    for column in ("node", "state", "GPUs", "memory", "inventory", "driver/CUDA", "heartbeat"):
        table.add_column(column)
    for node in nodes:
        state = STATE_TEXT.get(node.state, "?")
        if node.cordoned:
            state += " [yellow](cordoned)[/]"
        memory = sum(g.memory_bytes for g in node.gpus) / GiB
        declared = node.inventory_source == pb.INVENTORY_SOURCE_DECLARED
        versions = "/".join(v for v in (node.versions.driver, node.versions.cuda) if v) or "-"
        table.add_row(
            node.name,
            state,
            gpu_summary(node),
            f"{memory:,.0f} GiB",
            "[yellow]declared[/]" if declared else "nvml",
            versions,
            _age(node, now),
        )
    return table
