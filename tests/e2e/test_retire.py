"""Retiring surplus workers (``planner.retire_surplus``), with real processes: when the plan no
longer wants a worker, the executor stops routing to it, waits until every session it serves
has streamed to its end, and only then stops it. No session is cut short, and a model keeps at
least one serving worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from fleetshift_rpc.sessions import follow_session, routed_session
from tests.e2e.conftest import MODEL, NODES, SESSIONS, request

pytestmark = pytest.mark.slow
TOKENS = 400
GREEDY = SESSIONS[:2]


@pytest.fixture
def retiring_fleet(tmp_path: Path, model_dir: Path) -> Iterator[LocalFleet]:
    local = LocalFleet(
        tmp_path / "fleet",
        NODES,
        heartbeat_interval_s=0.3,
        node_lost_after_s=5.0,
        daemon_extra=(
            "[planner]\ninterval_s = 0\nretire_surplus = true\ndrain_timeout_s = 150\n"
            f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
            "tp_options = [1]\n"
        ),
        agent_extra="worker_compile = false\nworker_threads = 1\n",
    )
    try:
        local.start(timeout_s=120)
        yield local
    finally:
        local.stop()


async def refuses_new_sessions_while_draining(endpoint: str) -> bool:
    """Once the worker says it is draining, a new session there is refused with UNAVAILABLE."""
    async with grpc.aio.insecure_channel(endpoint) as ch:
        worker = worker_pb2_grpc.WorkerServiceStub(ch)
        deadline = time.monotonic() + 60
        while not (await worker.GetInfo(worker_pb2.GetWorkerInfoRequest())).draining:
            assert time.monotonic() < deadline, "the retiring worker was never told to drain"
            await asyncio.sleep(0.1)
        try:
            async for _ in worker.Generate(request(GREEDY[0], 5, "-late")):
                pass
        except grpc.aio.AioRpcError as err:
            return err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (err.details() or "")
        return False


async def tokens_of(stream: AsyncIterator[worker_pb2.GenerateResponse]) -> list[int]:
    return [msg.token async for msg in stream]


async def serving_sessions(endpoint: str) -> list[str]:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        info = await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(
            worker_pb2.GetWorkerInfoRequest()
        )
    return list(info.session_ids)


async def start_mixed_workers(
    ops: pb_grpc.OperationsStub, nodes: Sequence[NodeSpec]
) -> list[fpb.WorkerStatus]:
    """One mixed worker per node, started as the fleet's scheduler would."""
    return [
        await ops.StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name=n.name),
            timeout=180,
        )
        for n in nodes
    ]


async def workers_by_state(daemon: grpc.aio.Channel) -> dict[str, int]:
    listed = await ppb_grpc.PlanningStub(daemon).ListWorkers(ppb.ListWorkersRequest())
    return {w.worker_id: w.state for w in listed.workers}


async def test_rebalance_retires_surplus_workers_only_after_their_sessions_end(
    retiring_fleet: LocalFleet, reference_tokens
) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(retiring_fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        workers = await start_mixed_workers(ops, NODES)
        ended: dict[str, float] = {}
        started = asyncio.Event()
        counts: dict[str, int] = {}

        async def stream(worker: fpb.WorkerStatus, session) -> list[int]:  # type: ignore[no-untyped-def]
            tokens = []
            key = f"{worker.worker_id}/{session[0]}"
            async for msg in follow_session(
                daemon, worker.endpoint, request(session, TOKENS, f"-{worker.worker_id}")
            ):
                tokens.append(msg.token)
                counts[key] = len(tokens)
                if len(counts) == 2 * len(workers) and min(counts.values()) >= 10:
                    started.set()
            ended[worker.worker_id] = max(ended.get(worker.worker_id, 0.0), time.time())
            return tokens

        streams = {
            (w.worker_id, s[0]): asyncio.create_task(stream(w, s)) for w in workers for s in GREEDY
        }
        await asyncio.wait_for(started.wait(), 60)
        # No traffic reaches the router, so the best placement wants no worker at all; the
        # executor keeps one and retires the rest, each once its sessions have streamed out.
        op = await ops.Rebalance(pb.RebalanceRequest(reason="e2e retire"), timeout=30)
        first = next(s.worker_id for s in op.steps if s.kind == pb.STEP_KIND_RETIRE)
        endpoint = next(w.endpoint for w in workers if w.worker_id == first)
        refused = await refuses_new_sessions_while_draining(endpoint)
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
        results = {k: await asyncio.wait_for(t, 180) for k, t in streams.items()}

        assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
        assert refused, "a worker being retired must refuse a new session (route again)"
        retired = [s.worker_id for s in op.steps if s.kind == pb.STEP_KIND_RETIRE]
        assert len(retired) == len(workers) - 1, op
        assert all(s.phase == "done" for s in op.steps)
        for (_, sid), tokens in results.items():  # every session streamed to its end, exactly
            assert tokens == reference_tokens[TOKENS][sid]
        for step in op.steps:  # and its worker stopped only after that
            assert step.finished_at.ToNanoseconds() / 1e9 >= ended[step.worker_id]
        states = await workers_by_state(daemon)
        assert [w for w, st in states.items() if st == fpb.WORKER_STATE_SERVING] == [
            w.worker_id for w in workers if w.worker_id not in retired
        ]
        assert all(states[w] == fpb.WORKER_STATE_STOPPED for w in retired)
        # The model's last worker is never retired: another rebalance has nothing to retire.
        with pytest.raises(grpc.aio.AioRpcError) as nothing:
            await ops.Rebalance(pb.RebalanceRequest(reason="again"), timeout=30)
        assert nothing.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "nothing to move" in (nothing.value.details() or "")


async def test_a_client_refused_by_a_retiring_worker_is_routed_to_one_that_stays(
    retiring_fleet: LocalFleet, reference_tokens
) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(retiring_fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        workers = await start_mixed_workers(ops, NODES[:2])
        # A live session on each worker keeps the one being retired draining for a while.
        live = [
            asyncio.create_task(
                tokens_of(
                    follow_session(daemon, w.endpoint, request(GREEDY[1], TOKENS, w.worker_id))
                )
            )
            for w in workers
        ]
        deadline = time.monotonic() + 60
        while not all([await serving_sessions(w.endpoint) for w in workers]):
            assert time.monotonic() < deadline, "the live sessions never started"
            await asyncio.sleep(0.05)
        op = await ops.Rebalance(pb.RebalanceRequest(reason="retire one"), timeout=30)
        retiring = next(s.worker_id for s in op.steps if s.kind == pb.STEP_KIND_RETIRE)
        cached = next(w.endpoint for w in workers if w.worker_id == retiring)
        assert await refuses_new_sessions_while_draining(cached)

        # The client still holds the route to the retiring worker: refused, it routes again.
        tokens = await asyncio.wait_for(
            tokens_of(
                routed_session(
                    daemon,
                    ppb.RouteRequest(
                        model=MODEL, prompt_tokens=len(GREEDY[0][1]), expected_output_tokens=TOKENS
                    ),
                    request(GREEDY[0], TOKENS, "-rerouted"),
                    endpoint=cached,
                )
            ),
            180,
        )
        assert tokens == reference_tokens[TOKENS][GREEDY[0][0]]
        for task, w in zip(live, workers, strict=True):
            assert await asyncio.wait_for(task, 180) == reference_tokens[TOKENS][GREEDY[1][0]], w
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
        assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
        assert [s.worker_id for s in op.steps] == [retiring]
