"""The CLI's tables in an 80-column terminal: nothing cut to "…", low-value columns left out
(and said so) before a value is folded; and ``--help`` texts that read as plain text and show
their defaults."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import operations_pb2 as opb
from fleetshift_daemon.cli import main as cli
from fleetshift_daemon.cli.progress import operation_summary, operations_table
from fleetshift_daemon.cli.tables import DROP_FIRST, fit, nodes_table, workers_table

GiB = 1024**3


def rendered(table: object, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text()


def node(name: str, product: str, count: int) -> pb.Node:
    stamp = Timestamp()
    stamp.FromSeconds(1_000)
    gpus = [pb.Gpu(index=i, product_name=product, memory_bytes=80 * GiB) for i in range(count)]
    return pb.Node(
        name=name,
        state=pb.NODE_STATE_READY,
        gpus=gpus,
        inventory_source=pb.INVENTORY_SOURCE_DECLARED,
        last_heartbeat_at=stamp,
        versions=pb.NodeVersions(driver="550.54.15", cuda="12.4"),
    )


NODES = [
    node("a100-1", "NVIDIA A100-SXM4-80GB", 8),
    node("h100-1", "NVIDIA H100 80GB HBM3", 8),
    node("h200-1", "NVIDIA H200", 8),
]


def test_nodes_table_at_80_columns_keeps_every_value_whole() -> None:
    text = rendered(fit(nodes_table(NODES, now=1_001), 80, DROP_FIRST["nodes"]), 80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = re.sub(r"[\s│|]+", " ", text)
    for n in NODES:
        assert n.name in text
    assert "8x NVIDIA H100 80GB HBM3" in flat.replace(" 80GB HBM3", " 80GB HBM3")
    assert "left out at 80 columns" in text  # says what it dropped


def test_wide_terminal_shows_every_column() -> None:
    text = rendered(fit(nodes_table(NODES, now=1_001), 200, DROP_FIRST["nodes"]), 200)
    assert "driver/CUDA" in text and "550.54.15/12.4" in text and "left out" not in text


def test_workers_and_operations_tables_at_80_columns() -> None:
    workers = [
        pb.WorkerStatus(
            worker_id=f"w-{i:010x}",
            model="llama-70b",
            role=pb.WORKER_ROLE_DECODE,
            tensor_parallel=2,
            gpu_indices=[0, 1],
            endpoint=f"127.0.0.1:{40000 + i}",
            state=pb.WORKER_STATE_SERVING,
            node_name="h200-1",
            session_ids=["a", "b"],
        )
        for i in range(3)
    ]
    text = rendered(fit(workers_table(workers), 80, DROP_FIRST["workers"]), 80)
    assert "…" not in text and all(w.worker_id in text for w in workers)
    step = opb.OperationStep(
        index=0,
        kind=opb.STEP_KIND_COLD_START,
        worker_id="w-0123456789",
        new_worker_id="w-9876543210",
        target_node="h200-1",
        phase="switched",
        state=opb.STEP_STATE_DONE,
        sessions_carried=3,
    )
    op = opb.Operation(
        id="op-0123456789ab",
        kind=opb.OPERATION_KIND_REBALANCE,
        state=opb.OPERATION_STATE_SUCCEEDED,
        requested_by="planner (automatic mode)",
        reason="the traffic mix turned decode-heavy this afternoon",
        steps=[step],
    )
    for table, kind in (
        (operation_summary(op), "operation"),
        (operations_table([op]), "operations"),
    ):
        text = rendered(fit(table, 80, DROP_FIRST[kind]), 80)
        assert "…" not in text, text
        assert "w-9876543210" in text or "op-0123456789ab" in text


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["local-fleet", "--help"], ["nodes", "--help"], ["move", "--help"],
     ["efficiency", "--help"], ["demo", "--help"], ["gateway", "--help"],
     ["profile", "--help"], ["simulate", "--help"]],
)  # fmt: skip
def test_help_is_plain_text_with_defaults(argv: list[str]) -> None:
    text = help_text(argv)
    assert "``" not in text and ":func:" not in text and ".. " not in text
    description = text.split("\n\n")[1]  # after the usage lines
    assert not description.startswith("`"), description
    if argv[0] not in ("nodes", "move"):  # (move's options default to empty: nothing to show)
        assert "(default:" in text


def test_nodes_without_a_daemon_names_the_flag_and_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("FLEETSHIFT_DAEMON", raising=False)
    monkeypatch.setattr(cli, "DEFAULT_DAEMON", "127.0.0.1:1")
    monkeypatch.setattr(cli, "console", Console(width=200, file=io.StringIO(), record=True))
    assert cli.main(["--timeout", "2", "nodes"]) == 1
    text = cli.console.export_text()
    assert "--daemon HOST:PORT" in text and "FLEETSHIFT_DAEMON" in text
    assert "no --daemon given" in text
