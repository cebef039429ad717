"""Long operations on the terminal: a live progress bar fed by WatchOperation, and summaries."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc

console = Console(stderr=True)


def _name(enum_value: int, enum_type: object, prefix: str) -> str:
    return str(enum_type.Name(enum_value).removeprefix(prefix).lower())  # type: ignore[attr-defined]


def state_name(op: pb.Operation) -> str:
    return _name(op.state, pb.OperationState, "OPERATION_STATE_")


def _finished_steps(op: pb.Operation) -> int:
    done = (pb.STEP_STATE_DONE, pb.STEP_STATE_ROLLED_BACK, pb.STEP_STATE_SKIPPED)
    return sum(1 for s in op.steps if s.state in done)


def _current(op: pb.Operation) -> str:
    for s in op.steps:
        if s.state == pb.STEP_STATE_RUNNING:
            kind = _name(s.kind, pb.StepKind, "STEP_KIND_")
            return f"step {s.index} {kind} {s.worker_id} -> {s.target_node}: {s.phase}"
    return state_name(op)


def watch_operation(ch: grpc.Channel, op: pb.Operation) -> pb.Operation:
    """Follow an operation to its end: steps done, bytes moved and sessions carried, live."""
    stub = pb_grpc.OperationsStub(ch)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} steps"),
        TextColumn("{task.fields[moved]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(_current(op), total=max(len(op.steps), 1), moved="")
        for update in stub.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
            progress.update(
                task,
                completed=_finished_steps(op),
                description=_current(op),
                moved=f"{op.bytes_moved / 1e6:,.1f} MB, {op.sessions_carried} sessions",
            )
    return op


def operation_summary(op: pb.Operation) -> Table:
    table = Table(
        title=f"{op.id}: {state_name(op)} ({op.reason or 'no reason'}; by {op.requested_by})"
    )
    for column in (
        "step",
        "kind",
        "worker",
        "target",
        "phase",
        "state",
        "MB",
        "sessions",
        "pause ms",
        "error",
    ):
        table.add_column(column)
    for s in op.steps:
        table.add_row(
            str(s.index),
            _name(s.kind, pb.StepKind, "STEP_KIND_"),
            s.worker_id + (f" -> {s.new_worker_id}" if s.new_worker_id else ""),
            s.target_node,
            s.phase,
            _name(s.state, pb.StepState, "STEP_STATE_"),
            f"{s.bytes_moved / 1e6:,.1f}",
            str(s.sessions_carried),
            f"{s.max_session_pause_ms:.0f}",
            s.error,
        )
    return table


def operations_table(ops: Sequence[pb.Operation]) -> Table:
    table = Table(title=f"Operations (newest first): {len(ops)}")
    for column in ("id", "kind", "state", "by", "reason", "steps", "MB moved", "sessions"):
        table.add_column(column)
    for op in ops:
        table.add_row(
            op.id,
            _name(op.kind, pb.OperationKind, "OPERATION_KIND_"),
            state_name(op),
            op.requested_by,
            op.reason,
            f"{_finished_steps(op)}/{len(op.steps)}",
            f"{op.bytes_moved / 1e6:,.1f}",
            str(op.sessions_carried),
        )
    return table
