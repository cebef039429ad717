"""Moves while sessions stream, with real processes: a daemon, three agents (two declared
H100 nodes, one declared H200) and reference-engine workers. Every session's token stream
must equal an uninterrupted run's, and no request may fail."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import follow_session
from tests.e2e.conftest import MODEL, SESSIONS, request

pytestmark = pytest.mark.slow
TOKENS = 700


async def start_worker(ops: pb_grpc.OperationsStub, node: str) -> fpb.WorkerStatus:
    return await ops.StartWorker(
        pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name=node),
        timeout=180,
    )


async def stream_all(
    daemon: grpc.aio.Channel, endpoint: str, started: asyncio.Event
) -> dict[str, list[int]]:
    seen: dict[str, int] = {}

    async def one(session: tuple[str, list[int], float, int | None]) -> list[int]:
        tokens = []
        async for msg in follow_session(daemon, endpoint, request(session, TOKENS)):
            tokens.append(msg.token)
            seen[session[0]] = len(tokens)
            if len(seen) == len(SESSIONS) and min(seen.values()) >= 20:
                started.set()
        return tokens

    results = await asyncio.gather(*(one(s) for s in SESSIONS))
    return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}


async def move_while_streaming(
    fleet: LocalFleet, source_node: str, target_node: str
) -> tuple[pb.Operation, dict[str, list[int]], str]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await start_worker(ops, source_node)
        started = asyncio.Event()
        streams = asyncio.create_task(stream_all(daemon, worker.endpoint, started))
        await asyncio.wait_for(started.wait(), 60)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target_node, reason="e2e"),
            timeout=30,
        )
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
        tokens = await asyncio.wait_for(streams, 180)
        return op, tokens, worker.worker_id


async def serving_workers(fleet: LocalFleet) -> dict[str, str]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        listed = await ppb_grpc.PlanningStub(ch).ListWorkers(ppb.ListWorkersRequest())
    return {w.worker_id: w.endpoint for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING}


@pytest.mark.parametrize(
    ("target", "kind"),
    [("h100-b", pb.STEP_KIND_MIGRATE), ("h200-a", pb.STEP_KIND_COLD_START)],
    ids=["warm-h100-to-h100", "cold-h100-to-h200"],
)
async def test_move_while_streaming_keeps_every_token(
    fleet: LocalFleet, reference_tokens, target, kind
) -> None:  # type: ignore[no-untyped-def]
    op, tokens, source_id = await move_while_streaming(fleet, "h100-a", target)
    assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
    step = op.steps[0]
    assert step.kind == kind and step.phase == "done"
    assert step.sessions_carried >= 1, "the move should have caught sessions mid-stream"
    assert tokens == reference_tokens[TOKENS]
    serving = await serving_workers(fleet)
    assert source_id not in serving and list(serving) == [step.new_worker_id]
