"""Rendering of API answers as terminal tables (rich), separate from talking to the daemon."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_daemon.wire import ROLE_FROM_PB

GiB = 1024**3

# Per table, the columns an operator can best do without, first to go on a narrow terminal.
DROP_FIRST: dict[str, tuple[str, ...]] = {
    "nodes": ("driver/CUDA", "heartbeat", "memory"),
    "workers": ("endpoint", "KV used", "TP", "model"),
    "traffic": ("estimator MAE",),
    "plan": ("GB", "pause s"),
    "operation": ("phase", "MB", "pause ms"),
    "operations": ("MB moved", "reason"),
}


def fit(table: Table, width: int | None, drop: tuple[str, ...] = ()) -> Table:
    """Make ``table`` readable at ``width`` columns without cutting a value to "…".

    Columns in ``drop`` are left out, in that order, while the table is wider than the
    terminal (a caption names them); every remaining column folds a long value onto more
    lines instead of truncating it. ``None``: no limit (output that is not a terminal).
    """
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
    if width is None:
        return table
    measure = Console(width=width, file=None, force_terminal=False)
    dropped = []
    for header in drop:
        wide = Measurement.get(measure, measure.options.update_width(1 << 16), table).maximum
        if wide <= width:
            break
        for column in list(table.columns):
            if column.header == header:
                table.columns.remove(column)
                dropped.append(header)
    if dropped:
        table.caption = f"left out at {width} columns: {', '.join(dropped)} (widen to see them)"
    return table


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


ROLE_TEXT = {code: role.value for code, role in ROLE_FROM_PB.items()}  # the daemon's one mapping
NOMINAL_NOTE = "TP n*: nominal, declared GPUs reserved; the {} engine computes on one device"


class _Shape(Protocol):  # a WorkerStatus or a PlannedWorker
    tensor_parallel: int
    tensor_parallel_nominal: bool
    engine: str


def tp_text(w: _Shape) -> str:
    """A worker's TP, starred when nominal (the daemon's ``core.engine_fit``)."""
    return f"{w.tensor_parallel}*" if w.tensor_parallel_nominal else str(w.tensor_parallel)


def _nominal_caption(items: Sequence[_Shape]) -> str | None:
    engines = sorted({i.engine for i in items if i.tensor_parallel_nominal})
    return NOMINAL_NOTE.format("/".join(engines)) if engines else None


def workers_table(workers: Sequence[pb.WorkerStatus]) -> Table:
    table = Table(title=f"Workers: {len(workers)}")
    for column in (
        "worker",
        "node",
        "model",
        "role",
        "TP",
        "GPUs",
        "state",
        "sessions",
        "KV used",
        "endpoint",
    ):
        table.add_column(column)
    for w in workers:
        state = pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
        kv = (
            f"{w.counters.kv_blocks_used}/{w.counters.kv_blocks_total}"
            if w.HasField("counters") and w.counters.kv_blocks_total
            else "-"
        )
        table.add_row(
            w.worker_id,
            w.node_name or "-",
            w.model,
            ROLE_TEXT.get(w.role, "?"),
            tp_text(w),
            ",".join(str(i) for i in w.gpu_indices),
            state,
            str(len(w.session_ids)),
            kv,
            w.endpoint,
        )
    table.caption = _nominal_caption(workers)
    return table


def traffic_table(mix: object) -> Table:
    table = Table(title="Traffic mix (sliding window)")
    for column in (
        "model",
        "req/s",
        "prompt mean/p90",
        "output mean/p90",
        "prefill:decode",
        "estimator MAE",
        "baseline MAE",
        "completions",
    ):
        table.add_column(column)
    for m in mix.models:  # type: ignore[attr-defined]
        table.add_row(
            m.model,
            f"{m.arrival_rate_per_s:.2f}",
            f"{m.prompt_tokens.mean:.0f} / {m.prompt_tokens.p90:.0f}",
            f"{m.output_tokens.mean:.0f} / {m.output_tokens.p90:.0f}",
            f"{m.prefill_decode_ratio:.2f}",
            f"{m.estimator_mae_tokens:.1f}",
            f"{m.estimator_baseline_mae_tokens:.1f}",
            str(m.estimator_samples),
        )
    return table


def plan_table(plan: object) -> Table:
    p = plan
    title = (
        f"Plan: efficiency {p.efficiency_before:.3f}, goodput "  # type: ignore[attr-defined]
        f"{p.goodput_before_tokens_per_s:,.0f} -> {p.goodput_after_tokens_per_s:,.0f} tokens/s"  # type: ignore[attr-defined]
    )
    table = Table(title=title)
    for column in ("move", "model", "from", "to", "GB", "pause s", "sessions", "gain tok/s"):
        table.add_column(column)
    for m in p.moves:  # type: ignore[attr-defined]
        src = (
            f"{m.source.worker_id or '-'} {m.source.gpu_kind}@{m.source.node_name}"
            if m.HasField("source")
            else "-"
        )
        dst = (
            f"{ROLE_TEXT.get(m.target.role, '?')} {m.target.gpu_kind}"
            f" x{tp_text(m.target)}@{m.target.node_name}"
            if m.HasField("target")
            else "-"
        )
        table.add_row(
            type(m)
            .DESCRIPTOR.fields_by_name["kind"]
            .enum_type.values_by_number[m.kind]
            .name.removeprefix("MOVE_KIND_")
            .lower(),
            m.model,
            src,
            dst,
            f"{m.bytes_to_move / 1e9:.1f}",
            f"{m.expected_pause_s:.2f}",
            str(m.sessions_affected),
            f"{m.predicted_gain_tokens_per_s:,.0f}",
        )
    table.caption = _nominal_caption([m.target for m in p.moves if m.HasField("target")])  # type: ignore[attr-defined]
    return table
