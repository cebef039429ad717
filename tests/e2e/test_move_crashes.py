"""SIGKILL the daemon, the source agent or the destination agent at a step of a move.

Failpoints (``FLEETSHIFT_FAILPOINTS``) put the kill exactly at a phase of the daemon's
executor (``after:<phase>``), or inside an agent's handler while the daemon's call to it is in
flight (``agent:snapshot:written``, ``agent:fetch:received``, ``agent:start:serving``). Every
phase of a warm move is covered, and the phases of a cold move on either side of the switch.
Afterwards: every session's token stream equals an uninterrupted run (none lost, none
duplicated), the workers the registry says serve are exactly the ones running on the agents,
and the operation went the one way the recovery rule prescribes for that point: rolled back
before ``switched``, completed from it on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2, agent_pb2_grpc
from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_daemon.localfleet import LocalFleet
from tests.e2e.conftest import NODES, make_fleet
from tests.e2e.test_moves import TOKENS, start_worker, stream_all

pytestmark = pytest.mark.slow
SPEC = {n.name: n for n in NODES}


async def finished(ops: pb_grpc.OperationsStub, op_id: str, timeout_s: float = 180) -> pb.Operation:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            op = await ops.GetOperation(pb.GetOperationRequest(operation_id=op_id), timeout=5)
            if op.state in (pb.OPERATION_STATE_SUCCEEDED, pb.OPERATION_STATE_FAILED):
                return op
        except grpc.aio.AioRpcError:
            pass  # the daemon is restarting
        assert time.monotonic() < deadline, "operation did not finish"
        await asyncio.sleep(0.2)


async def registry_matches_agents(fleet: LocalFleet) -> set[str]:
    """The serving workers in the registry are exactly those running on the agents."""
    deadline = time.monotonic() + 30
    while True:
        async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
            listed = await ppb_grpc.PlanningStub(ch).ListWorkers(ppb.ListWorkersRequest())
            nodes = await fpb_grpc.FleetOperatorStub(ch).ListNodes(fpb.ListNodesRequest())
        registry = {w.worker_id for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING}
        running: set[str] = set()
        for node in nodes.nodes:
            async with grpc.aio.insecure_channel(node.agent_address) as ch:
                info = await agent_pb2_grpc.AgentServiceStub(ch).GetAgentInfo(
                    agent_pb2.GetAgentInfoRequest(), timeout=5
                )
            running |= {w.worker_id for w in info.workers if w.state == fpb.WORKER_STATE_SERVING}
        if registry == running or time.monotonic() > deadline:
            assert registry == running
            return registry
        await asyncio.sleep(0.3)


async def run_move(
    fleet: LocalFleet, marker: Path | None, on_hold, target: str = "h100-b"
) -> tuple[pb.Operation, dict[str, list[int]]]:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await start_worker(ops, "h100-a")
        started = asyncio.Event()
        streams = asyncio.create_task(stream_all(daemon, worker.endpoint, started))
        await asyncio.wait_for(started.wait(), 60)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target), timeout=30
        )
        if marker is not None:
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert time.monotonic() < deadline, "failpoint not reached"
                await asyncio.sleep(0.05)
            await on_hold()
            marker.unlink()
        else:
            await on_hold()
        final = await finished(ops, op.id)
        tokens = await asyncio.wait_for(streams, 240)
        return final, tokens


# Every phase a warm move (h100 -> h100) persists, and a cold move's (h100 -> h200) phases
# on either side of the switch; "done" has nothing left to recover.
FORWARD = ("switched", "source_retired")  # the target owns the sessions: completed forward
DAEMON_KILLS = [
    *(
        ("h100-b", phase)
        for phase in (
            "target_reserved",
            "snapshot_taken",
            "snapshot_fetched",
            "target_started",
            "source_paused",
            "sessions_copied",
            "switched",
            "source_retired",
        )
    ),
    ("h200-a", "target_started"),
    ("h200-a", "switched"),
]


def assert_rolled_back(op: pb.Operation) -> None:
    step = op.steps[0]
    assert op.state == pb.OPERATION_STATE_FAILED, op
    assert step.state == pb.STEP_STATE_ROLLED_BACK and step.error, op


def assert_completed(op: pb.Operation) -> None:
    step = op.steps[0]
    assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
    assert step.state == pb.STEP_STATE_DONE and step.phase == "done", op


@pytest.mark.parametrize(
    ("target", "phase"),
    DAEMON_KILLS,
    ids=[f"{'warm' if t == 'h100-b' else 'cold'}-{p}" for t, p in DAEMON_KILLS],
)
async def test_daemon_killed_at_a_phase(
    tmp_path: Path, model_dir: Path, reference_tokens, target: str, phase: str
) -> None:  # type: ignore[no-untyped-def]
    fleet = make_fleet(
        tmp_path / "fleet", model_dir, env={"FLEETSHIFT_FAILPOINTS": f"after:{phase}=crash"}
    )
    try:
        fleet.start(timeout_s=120)

        async def restart_daemon() -> None:
            assert fleet.daemon_proc is not None
            await asyncio.to_thread(fleet.daemon_proc.wait, 120)  # it SIGKILLs itself at the phase
            fleet.env = {}
            await asyncio.to_thread(fleet.start_daemon, 120)

        op, tokens = await run_move(fleet, None, restart_daemon, target)
        kind = pb.STEP_KIND_MIGRATE if target == "h100-b" else pb.STEP_KIND_COLD_START
        assert op.steps[0].kind == kind
        if phase in FORWARD:
            assert_completed(op)
        else:
            assert_rolled_back(op)
            assert "daemon restarted" in op.error and phase in op.error
        assert tokens == reference_tokens[TOKENS]
        assert len(await registry_matches_agents(fleet)) == 1
    finally:
        fleet.stop()


AGENT_KILLS = [
    # the source's agent, before the snapshot: SnapshotWorker finds it down -> rolled back
    ("h100-a", "target_reserved", False),
    # the destination's agent, before it fetches: FetchSnapshot finds it down -> rolled back
    ("h100-b", "snapshot_taken", False),
    # the destination's agent once its worker serves: the rest talks to the workers and to
    # the source's agent, so the move completes without it
    ("h100-b", "target_started", True),
]


@pytest.mark.parametrize(("node", "phase", "completes"), AGENT_KILLS)
async def test_agent_killed_at_a_phase(
    tmp_path: Path, model_dir: Path, reference_tokens, node: str, phase: str, completes: bool
) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "hold"
    fleet = make_fleet(
        tmp_path / "fleet", model_dir, env={"FLEETSHIFT_FAILPOINTS": f"after:{phase}=hold:{marker}"}
    )
    try:
        fleet.start(timeout_s=120)

        restarting: list[asyncio.Task[None]] = []

        async def kill_agent() -> None:
            fleet.kill_agent(node)

            async def come_back() -> None:  # the agent restarts a little later, as systemd would
                await asyncio.sleep(2.0)
                await asyncio.to_thread(fleet.start_agent, SPEC[node], 120)

            restarting.append(asyncio.get_running_loop().create_task(come_back()))

        op, tokens = await run_move(fleet, marker, kill_agent)
        if completes:
            assert_completed(op)
        else:
            assert_rolled_back(op)
        assert tokens == reference_tokens[TOKENS]
        await asyncio.gather(*restarting)
        await registered_anew(fleet, node)  # the restarted agent reports what it runs
        assert len(await registry_matches_agents(fleet)) == 1
    finally:
        fleet.stop()


# An agent that dies inside its handler, while the daemon's call to it is in flight: the call
# fails, the step rolls back, and the agent (restarted as systemd would) leaves only the
# source serving; a worker whose start it never answered is stopped when it re-adopts.
AGENT_CRASHES_IN_FLIGHT = [
    ("h100-a", "agent:snapshot:written"),  # SnapshotWorker: the snapshot is in the store
    ("h100-b", "agent:fetch:received"),  # FetchSnapshot: the copy is verified and stored
    ("h100-b", "agent:start:serving"),  # StartWorker: the restored worker already serves
]


async def registered_anew(fleet: LocalFleet, node: str, timeout_s: float = 60) -> None:
    """Until the daemon lists ``node`` at the port its (restarted) agent listens on now."""
    port_file = fleet.state_dir / f"agent-{node}.port"
    deadline = time.monotonic() + timeout_s
    while True:
        port = port_file.read_text().strip() if port_file.exists() else ""
        try:
            nodes = await asyncio.to_thread(fleet.list_nodes)
        except grpc.RpcError:
            nodes = []  # the daemon is restarting
        at = {n.name: n.agent_address for n in nodes if n.state == fpb.NODE_STATE_READY}
        if port and at.get(node, "").endswith(f":{port}"):
            return
        assert time.monotonic() < deadline, f"{node} did not register its new agent"
        await asyncio.sleep(0.1)


async def arm_agent(fleet: LocalFleet, node: str, failpoints: str) -> None:
    """Restart one agent with failpoints armed (the others must not hit them)."""
    fleet.kill_agent(node)
    fleet.env = {"FLEETSHIFT_FAILPOINTS": failpoints}
    try:
        await asyncio.to_thread(fleet.start_agent, SPEC[node], 120)
    finally:
        fleet.env = {}
    await registered_anew(fleet, node)


@pytest.mark.parametrize(("node", "failpoint"), AGENT_CRASHES_IN_FLIGHT)
async def test_agent_killed_while_its_call_is_in_flight(
    tmp_path: Path, model_dir: Path, reference_tokens, node: str, failpoint: str
) -> None:  # type: ignore[no-untyped-def]
    fleet = make_fleet(tmp_path / "fleet", model_dir)
    try:
        fleet.start(timeout_s=120)
        await arm_agent(fleet, node, f"{failpoint}=crash")
        armed = fleet.agent_procs[node]

        async def restart_agent() -> None:
            await asyncio.to_thread(armed.wait, 120)  # it SIGKILLs itself inside the handler
            await asyncio.to_thread(fleet.start_agent, SPEC[node], 120)

        op, tokens = await run_move(fleet, None, restart_agent)
        assert armed.returncode == -9, "the failpoint was not reached"
        assert_rolled_back(op)
        assert tokens == reference_tokens[TOKENS]
        await registered_anew(fleet, node)  # the restarted agent reports what it runs
        assert len(await registry_matches_agents(fleet)) == 1
    finally:
        fleet.stop()


async def test_daemon_killed_while_an_agent_call_is_in_flight(
    tmp_path: Path, model_dir: Path, reference_tokens
) -> None:  # type: ignore[no-untyped-def]
    """The source's agent holds inside SnapshotWorker; the daemon dies meanwhile. The agent
    finishes into a closed call, and the restarted daemon rolls the step back."""
    marker = tmp_path / "hold"
    fleet = make_fleet(tmp_path / "fleet", model_dir)
    try:
        fleet.start(timeout_s=120)
        await arm_agent(fleet, "h100-a", f"agent:snapshot:written=hold:{marker}")

        async def kill_and_restart_daemon() -> None:
            fleet.kill_daemon()  # run_move then releases the agent, into a closed call
            await asyncio.to_thread(fleet.start_daemon, 120)

        op, tokens = await run_move(fleet, marker, kill_and_restart_daemon)
        assert_rolled_back(op)
        assert "daemon restarted" in op.error and "target_reserved" in op.error
        assert tokens == reference_tokens[TOKENS]
        assert len(await registry_matches_agents(fleet)) == 1
    finally:
        fleet.stop()
