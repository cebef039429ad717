"""SIGKILL the daemon, the source agent or the destination agent at a step of a move.

Failpoints (``FLEETSHIFT_FAILPOINTS``) put the kill exactly at a phase. Afterwards: every
session's token stream equals an uninterrupted run (none lost, none duplicated), the workers
the registry says serve are exactly the ones running on the agents, and the operation says
whether the move completed or was rolled back.
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
    fleet: LocalFleet, marker: Path | None, on_hold
) -> tuple[pb.Operation, dict[str, list[int]]]:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await start_worker(ops, "h100-a")
        started = asyncio.Event()
        streams = asyncio.create_task(stream_all(daemon, worker.endpoint, started))
        await asyncio.wait_for(started.wait(), 60)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node="h100-b"), timeout=30
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


DAEMON_PHASES = [
    "target_reserved",
    "snapshot_fetched",
    "target_started",
    "sessions_copied",
    "switched",
]


@pytest.mark.parametrize("phase", DAEMON_PHASES)
async def test_daemon_killed_at_a_phase(
    tmp_path: Path, model_dir: Path, reference_tokens, phase: str
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

        op, tokens = await run_move(fleet, None, restart_daemon)
        step = op.steps[0]
        if phase == "switched":
            assert op.state == pb.OPERATION_STATE_SUCCEEDED and step.state == pb.STEP_STATE_DONE
        else:
            assert op.state == pb.OPERATION_STATE_FAILED and step.state == pb.STEP_STATE_ROLLED_BACK
            assert "daemon restarted" in op.error and phase in op.error
        assert tokens == reference_tokens[TOKENS]
        assert len(await registry_matches_agents(fleet)) == 1
    finally:
        fleet.stop()


AGENT_KILLS = [
    ("h100-a", "target_reserved"),  # the source's agent, before the snapshot
    ("h100-b", "snapshot_taken"),  # the destination's agent, before it fetches
    ("h100-b", "target_started"),  # the destination's agent, its worker already serving
]


@pytest.mark.parametrize(("node", "phase"), AGENT_KILLS)
async def test_agent_killed_at_a_phase(
    tmp_path: Path, model_dir: Path, reference_tokens, node: str, phase: str
) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "hold"
    fleet = make_fleet(
        tmp_path / "fleet", model_dir, env={"FLEETSHIFT_FAILPOINTS": f"after:{phase}=hold:{marker}"}
    )
    try:
        fleet.start(timeout_s=120)

        async def kill_agent() -> None:
            fleet.kill_agent(node)

            async def come_back() -> None:  # the agent restarts a little later, as systemd would
                await asyncio.sleep(2.0)
                await asyncio.to_thread(fleet.start_agent, SPEC[node], 120)

            asyncio.get_running_loop().create_task(come_back())

        op, tokens = await run_move(fleet, marker, kill_agent)
        step = op.steps[0]
        assert step.state in (pb.STEP_STATE_DONE, pb.STEP_STATE_ROLLED_BACK)
        if step.state == pb.STEP_STATE_ROLLED_BACK:
            assert op.state == pb.OPERATION_STATE_FAILED and step.error
        assert tokens == reference_tokens[TOKENS]
        await asyncio.sleep(2.5)  # the restarted agent reports what it runs
        assert len(await registry_matches_agents(fleet)) == 1
    finally:
        fleet.stop()
