"""The reference engine's one-device limit, applied by the daemon (issue 18).

The planner reasons about tensor-parallel 1/2/4/8; the reference engine computes on one device.
On real GPUs (an NVML inventory) the daemon refuses a TP > 1 reference worker itself, with
FAILED_PRECONDITION naming the model and the engine, before any agent call, and its planner
offers only TP 1; on a declared (CPU) inventory such a worker is accepted and labelled
nominal in ListWorkers, the plan and ``fleetshift workers``.

A real daemon (real gRPC, SQLite); agents are played by gRPC clients speaking the agent
protocol, whose address leads nowhere: a call the daemon made to the agent would fail with a
connection error, not with the engine's refusal (``test_...before_any_agent_call`` shows both).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import operations_pb2 as opb
from fleetshift.v1 import operations_pb2_grpc as opb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.config import ConfigError, DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.app import Daemon

from .clock import ManualClock

GiB = 1024**3
SMALL = "llama-30b"  # fits one H100 (barely): the planner may choose TP 1, 2 or 4
LARGE = "llama-70b"  # needs two H100s or more: no size the reference engine runs
NVML, DECLARED = fpb.INVENTORY_SOURCE_NVML, fpb.INVENTORY_SOURCE_DECLARED
LLAMA_30B = {  # LLaMA-30B's shape: 65 GB of BF16 weights leave an H100 little room for KV
    "model_type": "llama",
    "hidden_size": 6656,
    "intermediate_size": 17920,
    "num_hidden_layers": 60,
    "num_attention_heads": 52,
    "num_key_value_heads": 52,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

Worker = tuple[str, str, int]  # worker id, model, tp


async def heartbeat(
    agents: fpb_grpc.AgentRegistryStub, node: str, workers: Sequence[Worker]
) -> None:
    statuses = [
        fpb.WorkerStatus(
            worker_id=wid,
            model=model,
            role=fpb.WORKER_ROLE_MIXED,
            tensor_parallel=tp,
            dtype="bf16",
            gpu_indices=list(range(tp)),
            endpoint=f"127.0.0.1:{9100 + i}",
            state=fpb.WORKER_STATE_SERVING,
        )
        for i, (wid, model, tp) in enumerate(workers)
    ]
    await agents.Heartbeat(fpb.HeartbeatRequest(node_name=node, workers=statuses))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time())


@pytest.fixture
def fleet(tmp_path: Path, clock: ManualClock):  # type: ignore[no-untyped-def]
    """``fleet({node: (inventory, workers)})``: a daemon serving both models, with those nodes
    (eight H100s each) registered and reporting those workers."""
    config_dir = tmp_path / "llama-30b"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(LLAMA_30B))

    @contextlib.asynccontextmanager
    async def running(nodes: dict[str, tuple[int, Sequence[Worker]]]) -> AsyncIterator[Daemon]:
        state = tmp_path / f"state-{len(list(tmp_path.glob('state-*')))}"  # one per daemon
        config = DaemonConfig(
            listen="127.0.0.1:0",
            state_dir=str(state),
            database_url=f"sqlite:///{state / 'fleetshift.db'}",
            heartbeat_interval_s=0.2,
            node_lost_after_s=30.0,
            models=(
                ModelConfig(name=SMALL, hf_config=str(config_dir), tp_options=(1, 2, 4)),
                ModelConfig(name=LARGE, preset="llama2-70b", tp_options=(2, 4, 8)),
            ),
            planner=PlannerSettings(interval_s=0, hold_s=0.0),
        )
        daemon = Daemon(config, clock=clock)
        await daemon.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
                agents = fpb_grpc.AgentRegistryStub(ch)
                for name, (source, workers) in nodes.items():
                    gpus = [
                        fpb.Gpu(
                            index=i, product_name="NVIDIA H100 80GB HBM3", memory_bytes=80 * GiB
                        )
                        for i in range(8)
                    ]
                    await agents.RegisterNode(
                        fpb.RegisterNodeRequest(
                            node_name=name,
                            agent_address="127.0.0.1:1",
                            gpus=gpus,
                            inventory_source=source,
                        )
                    )
                    await heartbeat(agents, name, workers)
            yield daemon
        finally:
            await daemon.stop(0.1)

    return running


async def refused(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def assert_engine_refusal(err: grpc.aio.AioRpcError, model: str, tp: int, node: str) -> None:
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    details = err.details() or ""
    assert f"model {model!r}" in details and "'reference' engine" in details, details
    assert f"tensor_parallel {tp} on node {node!r} (real GPUs)" in details, details


async def listed(port: int) -> dict[str, pb.ListWorkersResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await pb_grpc.PlanningStub(ch).ListWorkers(pb.ListWorkersRequest())
    return {w.worker_id: w for w in reply.workers}


async def test_start_of_a_tp2_reference_worker_on_real_gpus_is_refused_before_any_agent_call(
    fleet,
) -> None:  # type: ignore[no-untyped-def]
    async with fleet({"gpu-1": (NVML, [])}) as daemon:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            ops = opb_grpc.OperationsStub(ch)

            def start(tp: int, node: str = "gpu-1") -> opb.StartFleetWorkerRequest:
                return opb.StartFleetWorkerRequest(
                    model=SMALL, role=fpb.WORKER_ROLE_MIXED, node_name=node, tensor_parallel=tp
                )

            on_node = await refused(ops.StartWorker(start(2), timeout=30))
            anywhere = await refused(ops.StartWorker(start(2, node=""), timeout=30))
            # TP 1 passes the daemon's checks and reaches the agent, which is not there.
            reached = await refused(ops.StartWorker(start(1), timeout=60))
        assert_engine_refusal(on_node, SMALL, 2, "gpu-1")
        assert_engine_refusal(anywhere, SMALL, 2, "gpu-1")
        assert "engine" not in (reached.details() or "") and "gpu-1" in (reached.details() or "")
        assert await listed(daemon.port) == {}  # nothing was recorded, nothing started


async def test_a_move_of_a_nominal_tp2_worker_onto_real_gpus_is_refused_and_records_nothing(
    fleet,
) -> None:  # type: ignore[no-untyped-def]
    nodes = {"cpu-1": (DECLARED, [("w-tp2", SMALL, 2)]), "gpu-1": (NVML, [])}
    async with fleet(nodes) as daemon:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            ops = opb_grpc.OperationsStub(ch)
            err = await refused(
                ops.MoveWorker(opb.MoveWorkerRequest(worker_id="w-tp2", target_node="gpu-1"))
            )
            history = await ops.ListOperations(opb.ListOperationsRequest())
        assert_engine_refusal(err, SMALL, 2, "gpu-1")
        assert list(history.operations) == []
        assert listed_state(await listed(daemon.port)) == {"w-tp2": ("cpu-1", 2)}


def listed_state(workers: dict[str, fpb.WorkerStatus]) -> dict[str, tuple[str, int]]:
    return {w.worker_id: (w.node_name, w.tensor_parallel) for w in workers.values()}


async def test_declared_fleets_label_tp_above_one_nominal_in_list_workers_and_the_cli(
    fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from fleetshift_daemon.cli.main import main as cli

    nodes = {"cpu-1": (DECLARED, [("w-tp4", LARGE, 4), ("w-tp1", SMALL, 1)])}
    async with fleet(nodes) as daemon:
        workers = await listed(daemon.port)
        monkeypatch.setenv("COLUMNS", "220")
        assert (
            await asyncio.to_thread(cli, ["--daemon", f"127.0.0.1:{daemon.port}", "workers"]) == 0
        )
    labels = {w.worker_id: (w.engine, w.tensor_parallel_nominal) for w in workers.values()}
    assert labels == {"w-tp4": ("reference", True), "w-tp1": ("reference", False)}
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.split("│")] for line in out.splitlines() if "w-tp" in line]
    tp_column = {row[1]: row[5] for row in cells}  # worker, node, model, role, TP
    assert tp_column == {"w-tp4": "4*", "w-tp1": "1"}, out
    assert "nominal" in out and "reference engine computes on one device" in out


async def route_decode_heavy(daemon: Daemon, clock: ManualClock, model: str) -> pb.Plan:
    """Enough decode-heavy demand that the best placement starts workers; then the dry run."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        placement = pb_grpc.PlacementStub(ch)
        for _ in range(200):
            await placement.Route(
                pb.RouteRequest(model=model, prompt_tokens=512, expected_output_tokens=1500)
            )
        clock.advance(1.0)
        return await pb_grpc.PlanningStub(ch).PlanRebalance(pb.PlanRebalanceRequest())


def targets(plan: pb.Plan) -> list[pb.PlannedWorker]:
    return [m.target for m in plan.moves if m.HasField("target") and m.target.model]


async def test_the_planner_offers_tp_above_one_only_where_it_is_nominal(
    fleet, clock: ManualClock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Same demand, same models: on a declared inventory the plan uses TP > 1 (labelled
    nominal, also in ``fleetshift plan``); on real GPUs it plans the engine's TP 1 only."""
    from fleetshift_daemon.cli.main import main as cli

    monkeypatch.setenv("COLUMNS", "220")
    async with fleet({"cpu-1": (DECLARED, [("w-small", SMALL, 1)])}) as daemon:
        declared = targets(await route_decode_heavy(daemon, clock, SMALL))
        address = f"127.0.0.1:{daemon.port}"
        assert await asyncio.to_thread(cli, ["--daemon", address, "plan"]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"x[248]\*@cpu-1", shown) and "nominal" in shown, shown
    async with fleet({"gpu-1": (NVML, [("w-small", SMALL, 1)])}) as daemon:
        real = targets(await route_decode_heavy(daemon, clock, SMALL))

    assert any(t.tensor_parallel > 1 for t in declared), declared
    assert all(t.tensor_parallel_nominal == (t.tensor_parallel > 1) for t in declared)
    assert real and {t.tensor_parallel for t in real} == {1}, real
    assert not any(t.tensor_parallel_nominal for t in real)
    assert {t.engine for t in declared + real} == {"reference"}


async def test_a_rebalance_that_needs_a_size_the_engine_cannot_run_is_refused_by_name(
    fleet, clock: ManualClock
) -> None:  # type: ignore[no-untyped-def]
    """Llama-2-70B fits no single H100, so no configured size is one the reference engine
    runs: the plan keeps TP 2/4/8 on the real-GPU node (not labelled nominal there) and the
    daemon refuses to execute it, naming why, instead of dropping those steps and answering
    "nothing to move". (The declared node is full with one nominal TP-8 worker.)"""
    nodes = {"cpu-1": (DECLARED, [("w-large", LARGE, 8)]), "gpu-1": (NVML, [])}
    async with fleet(nodes) as daemon:
        plan = await route_decode_heavy(daemon, clock, LARGE)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            ops = opb_grpc.OperationsStub(ch)
            err = await refused(ops.Rebalance(opb.RebalanceRequest(reason="tp"), timeout=30))
            history = await ops.ListOperations(opb.ListOperationsRequest())
    on_gpus = [t for t in targets(plan) if t.node_name == "gpu-1"]
    assert on_gpus and all(t.tensor_parallel > 1 for t in on_gpus), plan
    assert not any(t.tensor_parallel_nominal for t in on_gpus)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    details = err.details() or ""
    assert f"model {LARGE!r}" in details and "'reference' engine" in details, details
    # (Rebalance plans afresh; whichever of its steps lands on gpu-1 first is the one named.)
    assert re.search(r"tensor_parallel [248] on node 'gpu-1' \(real GPUs\)", details), details
    assert list(history.operations) == []


def test_a_model_names_a_known_engine() -> None:
    assert ModelConfig(name="m", preset="llama2-70b").engine == "reference"
    with pytest.raises(ConfigError) as err:
        ModelConfig(name="m", preset="llama2-70b", engine="tensorrt")
    assert err.value.field == "models.engine"
    assert "'tensorrt'" in str(err.value) and "reference" in str(err.value)
