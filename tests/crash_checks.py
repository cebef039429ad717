"""What the crash tests share (tests/e2e/test_move_crashes.py, tests/vllm/test_vllm_move_crashes.py):
arming failpoints in a running fleet, waiting for a hold to be reached and for restarted
processes to report again, and the two outcomes the forward rule allows a move."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path

import grpc

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift_common.failpoints import FILE_ENV
from fleetshift_daemon.localfleet import LocalFleet


def arm(fleet: LocalFleet, failpoints: str) -> None:
    """Arm ``failpoints`` in every process of the fleet (each name is hit by one process of a
    move only), written whole so that no process reads half of it."""
    path = Path(fleet.env[FILE_ENV])
    path.with_suffix(".new").write_text(failpoints)
    path.with_suffix(".new").replace(path)


def armed(fleet: LocalFleet) -> bool:
    path = Path(fleet.env[FILE_ENV])
    return path.exists() and bool(path.read_text().strip())


def assert_rolled_back(op: pb.Operation, phase: str = "") -> None:
    step = op.steps[0]
    assert op.state == pb.OPERATION_STATE_FAILED, op
    assert step.state == pb.STEP_STATE_ROLLED_BACK and step.error, op
    if phase:  # the restarted daemon found the step there, and said so
        assert "daemon restarted" in op.error and repr(phase) in op.error, op.error


def assert_completed(op: pb.Operation) -> None:
    step = op.steps[0]
    assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
    assert step.state == pb.STEP_STATE_DONE and step.phase == "done", op


async def released(marker: Path, timeout_s: float = 180) -> None:
    """Wait for a ``hold`` failpoint to be reached (its marker appears)."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < deadline, "failpoint not reached"
        await asyncio.sleep(0.05)


async def heartbeating(
    fleet: LocalFleet, since: float, nodes: Iterable[str], timeout_s: float = 60
) -> None:
    """Until every one of ``nodes`` has heartbeated to the daemon after ``since`` (it
    restarted then)."""
    want = set(nodes)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = await asyncio.to_thread(fleet.list_nodes)
        except grpc.RpcError:
            listed = []
        fresh = {
            n.name
            for n in listed
            if n.state == fpb.NODE_STATE_READY and n.last_heartbeat_at.ToNanoseconds() / 1e9 > since
        }
        if fresh >= want:
            return
        assert time.monotonic() < deadline, f"agents not heartbeating: {sorted(want - fresh)}"
        await asyncio.sleep(0.1)


async def registered_anew(fleet: LocalFleet, node: str, timeout_s: float = 60) -> None:
    """Until the daemon lists ``node`` at the port its (restarted) agent listens on now."""
    port_file = fleet.state_dir / f"agent-{node}.port"
    deadline = time.monotonic() + timeout_s
    while True:
        port = port_file.read_text().strip() if port_file.exists() else ""
        try:
            listed = await asyncio.to_thread(fleet.list_nodes)
        except grpc.RpcError:
            listed = []  # the daemon is restarting
        at = {n.name: n.agent_address for n in listed if n.state == fpb.NODE_STATE_READY}
        if port and at.get(node, "").endswith(f":{port}"):
            return
        assert time.monotonic() < deadline, f"{node} did not register its new agent"
        await asyncio.sleep(0.1)
