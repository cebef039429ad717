"""The Operations API's refusals and bookkeeping, over real gRPC.

Nodes (a declared inventory) and workers are declared by real gRPC clients speaking the agent protocol (their agent
addresses lead nowhere), so a move that passes validation fails at its first agent call: that
is used here to check that a failed operation rolls back and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_common.errors import FailedPrecondition
from fleetshift_common.vocabulary import Role
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.operations import OperationKind, StepKind
from fleetshift_daemon.core.perfmodel import Dtype
from fleetshift_daemon.core.plans import MoveKind

from .agent.fleet import eventually

GiB = 1024**3
NODES = {
    "h100-1": ("NVIDIA H100 80GB HBM3", 80),
    "h100-2": ("NVIDIA H100 80GB HBM3", 80),
    "h200-1": ("NVIDIA H200", 141),
    "l40s-1": ("NVIDIA L40S", 48),
    "gone-1": ("NVIDIA H100 80GB HBM3", 80),
}
WORKERS = {  # node -> (worker, model, role, tp, gpus)
    "h100-1": [("w1", "llama-70b", fpb.WORKER_ROLE_DECODE, 4, [0, 1, 2, 3])],
    "h200-1": [
        ("w2", "llama-70b", fpb.WORKER_ROLE_PREFILL, 2, [0, 1]),
        ("g1", "llama-guarded", fpb.WORKER_ROLE_MIXED, 2, [2, 3]),
    ],
}


async def heartbeat(agents: fpb_grpc.AgentRegistryStub, node: str) -> None:
    statuses = [
        fpb.WorkerStatus(
            worker_id=wid,
            model=model,
            role=role,
            tensor_parallel=tp,
            gpu_indices=gpus,
            endpoint="127.0.0.1:1",
            state=fpb.WORKER_STATE_SERVING,
        )
        for wid, model, role, tp, gpus in WORKERS.get(node, [])
    ]
    await agents.Heartbeat(fpb.HeartbeatRequest(node_name=node, workers=statuses))


@contextlib.asynccontextmanager
async def running_daemon(
    tmp_path: Path, sqlite_url: str, planner: PlannerSettings
) -> AsyncIterator[Daemon]:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        heartbeat_interval_s=0.1,
        node_lost_after_s=0.5,
        liveness_check_interval_s=0.05,
        models=(
            ModelConfig(name="llama-70b", preset="llama2-70b", tp_options=(2, 4, 8)),
            ModelConfig(name="llama-guarded", preset="llama2-70b", tp_options=(2,), min_workers=1),
        ),
        planner=planner,
    )
    app = Daemon(config)
    await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        for node, (product, gb) in NODES.items():
            gpus = [fpb.Gpu(index=i, product_name=product, memory_bytes=gb * GiB) for i in range(8)]
            await agents.RegisterNode(
                fpb.RegisterNodeRequest(
                    node_name=node,
                    agent_address="127.0.0.1:1",
                    gpus=gpus,
                    # a declared inventory: the reference engine's TP > 1 workers are nominal
                    # there (on real GPUs the daemon refuses them, tests/test_engine_tp.py)
                    inventory_source=fpb.INVENTORY_SOURCE_DECLARED,
                )
            )
        await fpb_grpc.FleetOperatorStub(ch).CordonNode(
            fpb.CordonNodeRequest(node_name="h100-2", reason="bad fan")
        )
        # gone-1 never heartbeats. Waited for, not slept on: the daemon times silences on its
        # hearing clock (core/hearing.py), which stops while its loop stalls, so on a loaded
        # machine 0.8 s once was not enough (CI: a drain then chose gone-1).
        operator = fpb_grpc.FleetOperatorStub(ch)
        await eventually(
            lambda: operator.GetNode(fpb.GetNodeRequest(node_name="gone-1")),
            lambda node: node.state == fpb.NODE_STATE_LOST,
            timeout_s=10,
        )

        async def keep_alive() -> None:  # the other "agents" heartbeat all along
            while True:
                for node in NODES:
                    if node != "gone-1":
                        await heartbeat(agents, node)
                await asyncio.sleep(0.1)

        # One whole round first, awaited, so every worker below is known before the test
        # starts (a sleep alone once ended before h200-1's beat under load: "w2 is not known").
        for node in NODES:
            if node != "gone-1":
                await heartbeat(agents, node)
        beats = asyncio.create_task(keep_alive())
        await asyncio.sleep(0.2)
        known = {w.id for w in app.workers.all()}  # type: ignore[union-attr]
        assert {w[0] for ws in WORKERS.values() for w in ws} <= known, known
        try:
            yield app
        finally:
            beats.cancel()
            await app.stop(0.1)


@pytest.fixture
async def daemon(tmp_path: Path, sqlite_url: str) -> AsyncIterator[Daemon]:
    async with running_daemon(tmp_path, sqlite_url, PlannerSettings(interval_s=0)) as app:
        yield app


@pytest.fixture
async def ops(daemon: Daemon) -> AsyncIterator[pb_grpc.OperationsStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        yield pb_grpc.OperationsStub(ch)


REFUSED = [
    (
        pb.MoveWorkerRequest(worker_id="ghost", target_node="h100-1"),
        grpc.StatusCode.NOT_FOUND,
        "ghost",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w1", target_node="h100-2"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "cordoned",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w1", target_node="gone-1"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "lost",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w1", target_node="nowhere"),
        grpc.StatusCode.NOT_FOUND,
        "nowhere",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w2", target_node="l40s-1"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "does not fit",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w2", target_node="h100-1", target_gpus=[2, 3]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "held by another worker",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w2", target_node="h100-1", target_gpus=[8, 9]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "no GPU",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w2", target_node="h100-1", target_gpus=[4]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "target_gpus",
    ),
    (
        pb.MoveWorkerRequest(worker_id="g1", target_node="h100-1"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "minimum",
    ),
    (
        pb.MoveWorkerRequest(worker_id="w1", target_node="h100-1"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "changes nothing",
    ),
    (
        pb.MoveWorkerRequest(worker_id="", target_node="h100-1"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "worker_id",
    ),
]


@pytest.mark.parametrize(("request_msg", "code", "named"), REFUSED)
async def test_refused_moves_start_nothing(daemon: Daemon, ops, request_msg, code, named) -> None:  # type: ignore[no-untyped-def]
    before = {w.id: (w.node, w.state) for w in daemon.workers.all()}  # type: ignore[union-attr]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.MoveWorker(request_msg)
    assert err.value.code() == code
    assert named in err.value.details()
    assert list((await ops.ListOperations(pb.ListOperationsRequest())).operations) == []
    assert {w.id: (w.node, w.state) for w in daemon.workers.all()} == before  # type: ignore[union-attr]


async def test_unknown_operations_are_not_found(ops) -> None:  # type: ignore[no-untyped-def]
    for call in (
        ops.GetOperation(pb.GetOperationRequest(operation_id="op-nope")),
        ops.CancelOperation(pb.CancelOperationRequest(operation_id="op-nope")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "op-nope" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.LocateSession(pb.LocateSessionRequest(session_id="s-unknown"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_drain_of_unknown_or_empty_node(ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.Drain(pb.DrainRequest(node_name="nowhere"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.Drain(pb.DrainRequest(node_name="l40s-1"))
    # A valid request with nothing to do is a failed precondition, which a script can tell
    # from a missing node (NOT_FOUND above).
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "nothing to move" in err.value.details()
    )


async def test_idempotency_key_runs_once_and_refuses_another_request(daemon: Daemon, ops) -> None:  # type: ignore[no-untyped-def]
    move = pb.MoveWorkerRequest(
        worker_id="w1", target_node="h200-1", idempotency_key="k-1", reason="test"
    )
    first = await ops.MoveWorker(move)
    again = await ops.MoveWorker(move)
    assert again.id == first.id
    other = pb.MoveWorkerRequest(
        worker_id="w1", target_node="h100-1", target_gpus=[4, 5, 6, 7], idempotency_key="k-1"
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.MoveWorker(other)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "k-1" in err.value.details()
    assert len((await ops.ListOperations(pb.ListOperationsRequest())).operations) == 1

    # The agents here are unreachable: the move fails at its first agent call and rolls back.
    final = None
    async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=first.id)):
        final = update
    assert final is not None and final.state == pb.OPERATION_STATE_FAILED
    assert final.steps[0].state == pb.STEP_STATE_ROLLED_BACK and final.steps[0].error
    assert final.steps[0].kind == pb.STEP_KIND_COLD_START  # H100 -> H200: another GPU model
    assert final.requested_by
    w1 = daemon.workers.get("w1")  # type: ignore[union-attr]
    assert (w1.node, w1.state.value, w1.operation_id) == ("h100-1", "serving", "")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        listed = await ppb_grpc.PlanningStub(ch).ListWorkers(
            ppb.ListWorkersRequest(node_name="h200-1")
        )
    assert {w.worker_id for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING} == {
        "w2",
        "g1",
    }


async def test_migrate_between_same_gpu_models_is_warm(daemon: Daemon, ops) -> None:  # type: ignore[no-untyped-def]
    op = await ops.MoveWorker(
        pb.MoveWorkerRequest(worker_id="w1", target_node="h100-1", target_gpus=[4, 5, 6, 7])
    )
    assert op.steps[0].kind == pb.STEP_KIND_MIGRATE
    role = await ops.MoveWorker(
        pb.MoveWorkerRequest(
            worker_id="w2", target_node="h200-1", target_role=fpb.WORKER_ROLE_DECODE
        )
    )
    assert role.steps[0].kind == pb.STEP_KIND_ROLE_CHANGE


async def test_a_retirement_that_cannot_drain_rolls_back_and_the_worker_serves_on(
    tmp_path: Path, sqlite_url: str
) -> None:
    planner = PlannerSettings(interval_s=0, retire_surplus=True, drain_timeout_s=5)
    async with (
        running_daemon(tmp_path, sqlite_url, planner) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch,
    ):
        assert app.moves is not None and app.operations is not None and app.executor
        # With no traffic the plan stops every llama-70b worker; retire_surplus turns that into
        # retirements, but never of the model's last worker: one of w1 / w2 goes.
        plan = app.placement.dry_run()
        stops = [m.source.worker_id for m in plan.moves if m.kind is MoveKind.STOP and m.source]
        assert sorted(stops) == ["w1", "w2"]
        retiring = [s for s in app.moves.plan_steps(plan) if s.kind is StepKind.RETIRE]
        assert [s.worker_id for s in retiring] == [stops[0]]
        # The retirement asks its worker how many sessions it still serves; this endpoint leads
        # nowhere, so the step rolls back: the worker is never stopped and serves on.
        alone = (dataclasses.replace(retiring[0], index=0),)
        op, _ = app.operations.create(OperationKind.REBALANCE, "test", "retire", alone)
        app.executor.submit(op)
        ops = pb_grpc.OperationsStub(ch)
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            watched = update
        assert watched.state == pb.OPERATION_STATE_FAILED, watched
        (step,) = watched.steps
        assert step.kind == pb.STEP_KIND_RETIRE and step.state == pb.STEP_STATE_ROLLED_BACK
        assert step.error
        listed = await ppb_grpc.PlanningStub(ch).ListWorkers(ppb.ListWorkersRequest())
        assert {w.worker_id: w.state for w in listed.workers} == {
            "w1": fpb.WORKER_STATE_SERVING,
            "w2": fpb.WORKER_STATE_SERVING,
            "g1": fpb.WORKER_STATE_SERVING,
        }


async def test_a_failed_step_reads_as_one_sentence_naming_the_peer(daemon: Daemon, ops) -> None:  # type: ignore[no-untyped-def]
    op = await ops.MoveWorker(pb.MoveWorkerRequest(worker_id="w1", target_node="h200-1"))
    async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
        op = update
    (step,) = op.steps
    assert op.state == pb.OPERATION_STATE_FAILED and step.state == pb.STEP_STATE_ROLLED_BACK
    # The target's agent (127.0.0.1:1) is unreachable: its refusal, in the catalogue's words.
    assert step.error.startswith("agent of node 'h200-1': "), step.error
    assert op.error == f"step 0 (cold_start of w1): {step.error}"
    for wire_dump in ("\n", "debug_error_string", "AioRpcError", "<", "StatusCode."):
        assert wire_dump not in op.error, op.error


async def test_an_idempotency_key_reused_with_another_reason_is_refused(
    daemon: Daemon, ops
) -> None:  # type: ignore[no-untyped-def]
    move = pb.MoveWorkerRequest(
        worker_id="w1", target_node="h200-1", idempotency_key="k-r", reason="first"
    )
    first = await ops.MoveWorker(move)
    assert (await ops.MoveWorker(move)).id == first.id
    move.reason = "second"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.MoveWorker(move)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "k-r" in (err.value.details() or "") and first.id in (err.value.details() or "")
    assert len((await ops.ListOperations(pb.ListOperationsRequest())).operations) == 1


async def test_drain_cordons_the_node_and_prefers_a_warm_move(daemon: Daemon, ops) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        operator = fpb_grpc.FleetOperatorStub(ch)
        await operator.UncordonNode(fpb.UncordonNodeRequest(node_name="h100-2"))
        # A free H100 (same GPU model: a warm move) and a free H200 (cold) can both take w1.
        op = await ops.Drain(pb.DrainRequest(node_name="h100-1", reason="firmware"))
        (step,) = op.steps
        assert (step.worker_id, step.kind, step.target_node) == (
            "w1",
            pb.STEP_KIND_MIGRATE,
            "h100-2",
        )
        nodes = {n.name: n for n in (await operator.ListNodes(fpb.ListNodesRequest())).nodes}
    assert nodes["h100-1"].cordoned and "firmware" in nodes["h100-1"].cordon_reason
    assert not nodes["h100-2"].cordoned
    assert daemon.placement is not None
    with pytest.raises(FailedPrecondition):  # nothing new lands on the node while it empties
        daemon.placement.place_worker(
            "llama-70b", Role.DECODE, 4, Dtype.BF16, exclude_nodes=set(NODES) - {"h100-1"}
        )


async def test_a_refused_drain_cordons_nothing(daemon: Daemon, ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ops.Drain(pb.DrainRequest(node_name="l40s-1"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert daemon.registry is not None and not daemon.registry.get("l40s-1").cordoned


async def test_rebalance_refuses_a_plan_that_does_not_pay_off(
    tmp_path: Path, sqlite_url: str
) -> None:
    # A horizon of one second: no move's cost is won back in it.
    planner = PlannerSettings(interval_s=0, horizon_s=1.0)
    async with (
        running_daemon(tmp_path, sqlite_url, planner) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch,
    ):
        placement = ppb_grpc.PlacementStub(ch)
        for _ in range(60):  # decode-heavy: the plan wants more decode capacity
            await placement.Route(
                ppb.RouteRequest(model="llama-70b", prompt_tokens=128, expected_output_tokens=1500)
            )
        plan = await ppb_grpc.PlanningStub(ch).PlanRebalance(ppb.PlanRebalanceRequest())
        assert not plan.pays_off
        assert {m.kind for m in plan.moves} - {ppb.MOVE_KIND_STOP}, plan  # moves, not only stops
        ops = pb_grpc.OperationsStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ops.Rebalance(pb.RebalanceRequest(reason="no gain"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not pay off" in (err.value.details() or "")
        assert list((await ops.ListOperations(pb.ListOperationsRequest())).operations) == []
