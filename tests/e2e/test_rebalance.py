"""Rebalancing a live fleet: automatically, when the traffic mix turns decode-heavy, and by an
operator using grpcurl alone.

The agents run reference-engine workers on this CPU; the daemon plans them as a
Llama-2-70B-class model at tensor-parallel 2 on the nodes' declared GPUs (the performance model
is analytic, so the plan is what it would be on that hardware; nothing here is measured on a
GPU). Traffic is described to the daemon through Route, as the fleet's router would.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec

pytestmark = pytest.mark.slow
MODEL = "llama-70b"
DECODING = (fpb.WORKER_ROLE_DECODE, fpb.WORKER_ROLE_MIXED)
NODES = (
    NodeSpec("h100-a", "NVIDIA H100 80GB HBM3", 4),
    NodeSpec("h100-b", "NVIDIA H100 80GB HBM3", 4),
    NodeSpec("h200-a", "NVIDIA H200", 4),
)


def rebalance_fleet(root: Path, model_dir: Path, automatic: bool) -> LocalFleet:
    return LocalFleet(
        root,
        NODES,
        heartbeat_interval_s=0.3,
        node_lost_after_s=5.0,
        daemon_extra=(
            f"[planner]\ninterval_s = 1.0\nthreshold = 0.97\nhold_s = 0\nhorizon_s = 3600\n"
            f"automatic = {'true' if automatic else 'false'}\nmax_moves_in_flight = 2\n"
            f'[[models]]\nname = "{MODEL}"\npreset = "llama2-70b"\nmodel_dir = "{model_dir}"\n'
            "tp_options = [2]\nslo_ttft_ms = 2000\nslo_tbt_ms = 60\n"
        ),
        agent_extra="worker_compile = false\nworker_threads = 1\n",
    )


async def place_initial(daemon: grpc.aio.Channel) -> dict[str, str]:
    """Decode on an H100, prefill on the H200: wrong once the mix is decode-heavy."""
    ops = pb_grpc.OperationsStub(daemon)
    out = {}
    for node, role in (("h100-a", fpb.WORKER_ROLE_DECODE), ("h200-a", fpb.WORKER_ROLE_PREFILL)):
        w = await ops.StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=role, tensor_parallel=2, node_name=node),
            timeout=180,
        )
        out[w.worker_id] = node
    return out


async def decode_heavy_traffic(daemon: grpc.aio.Channel, requests: int = 300) -> None:
    route = ppb_grpc.PlacementStub(daemon).Route
    for i in range(requests):
        await route(
            ppb.RouteRequest(model=MODEL, prompt_tokens=100 + i % 50, expected_output_tokens=1800)
        )


@pytest.fixture
def fleet_factory(tmp_path: Path, model_dir: Path) -> Iterator:  # type: ignore[type-arg]
    fleets: list[LocalFleet] = []

    def make(automatic: bool) -> LocalFleet:
        fleet = rebalance_fleet(tmp_path / "fleet", model_dir, automatic)
        fleets.append(fleet)
        fleet.start(timeout_s=120)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()


async def serving_decode_nodes(daemon: grpc.aio.Channel) -> dict[str, str]:
    """Serving workers that decode (decode or mixed role) -> node, from the registry (nodes are
    learnt by node filter). Which of the two the plan picks for the H200 depends on the demand
    the traffic window measured, i.e. on how fast this machine sent the traffic."""
    planning = ppb_grpc.PlanningStub(daemon)
    out = {}
    for spec in NODES:
        listed = await planning.ListWorkers(ppb.ListWorkersRequest(node_name=spec.name))
        for w in listed.workers:
            if w.state == fpb.WORKER_STATE_SERVING and w.role in DECODING:
                out[w.worker_id] = spec.name
    return out


async def serving_workers(daemon: grpc.aio.Channel) -> dict[str, tuple[str, str]]:
    """Serving workers -> (node, role name), from the registry."""
    planning = ppb_grpc.PlanningStub(daemon)
    out = {}
    for spec in NODES:
        listed = await planning.ListWorkers(ppb.ListWorkersRequest(node_name=spec.name))
        for w in listed.workers:
            if w.state == fpb.WORKER_STATE_SERVING:
                out[w.worker_id] = (spec.name, fpb.WorkerRole.Name(w.role))
    return out


async def test_automatic_mode_moves_decode_to_the_h200_and_efficiency_rises(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(True)
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        await place_initial(daemon)
        planning = ppb_grpc.PlanningStub(daemon)
        ops = pb_grpc.OperationsStub(daemon)
        await decode_heavy_traffic(daemon)
        deadline = time.monotonic() + 240
        automatic: list[pb.Operation] = []
        while time.monotonic() < deadline:
            listed = await ops.ListOperations(pb.ListOperationsRequest())
            automatic = [o for o in listed.operations if "automatic" in o.requested_by]
            done = automatic and all(o.state == pb.OPERATION_STATE_SUCCEEDED for o in automatic)
            if done and "h200-a" in (await serving_decode_nodes(daemon)).values():
                break
            await decode_heavy_traffic(daemon, 20)  # the mix stays decode-heavy
            await asyncio.sleep(0.5)
        assert automatic, "the planner never executed a plan on its own"
        assert all(o.state == pb.OPERATION_STATE_SUCCEEDED for o in automatic), automatic
        assert "h200-a" in (await serving_decode_nodes(daemon)).values()
        # Efficiency: below the threshold before the move, higher after it.
        await asyncio.sleep(2.5)
        report = await planning.GetEfficiency(ppb.GetEfficiencyRequest(history=200))
        moved_at = min(o.created_at.ToNanoseconds() for o in automatic) / 1e9
        before = [
            s.efficiency for s in report.history if s.taken_at.ToNanoseconds() / 1e9 <= moved_at
        ]
        after = report.latest.efficiency
        assert before and min(before) < report.threshold
        assert after > min(before), (before, after)


def grpcurl_call(binary: str, address: str, method: str, data: dict) -> str:  # type: ignore[type-arg]
    result = subprocess.run(
        [binary, "-plaintext", "-max-time", "300", "-d", json.dumps(data), address, method],
        capture_output=True, text=True, timeout=320,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_operator_drives_a_rebalance_with_grpcurl_only(fleet_factory, grpcurl: str) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(False)
    address = fleet.daemon_address
    async with grpc.aio.insecure_channel(address) as daemon:
        await place_initial(daemon)  # (the fleet's scheduler)
        await decode_heavy_traffic(daemon)  # (the fleet's router)
    run = asyncio.to_thread
    plan = json.loads(
        await run(grpcurl_call, grpcurl, address, "fleetshift.v1.Planning/PlanRebalance", {})
    )
    assert plan["moves"] and plan["efficiency_before"] < 1
    request = {"idempotency_key": "rebalance-1", "reason": "decode-heavy afternoon"}
    op = json.loads(
        await run(grpcurl_call, grpcurl, address, "fleetshift.v1.Operations/Rebalance", request)
    )
    again = json.loads(
        await run(grpcurl_call, grpcurl, address, "fleetshift.v1.Operations/Rebalance", request)
    )
    assert again["id"] == op["id"]
    stream = await run(
        grpcurl_call,
        grpcurl,
        address,
        "fleetshift.v1.Operations/WatchOperation",
        {"operation_id": op["id"]},
    )
    assert '"OPERATION_STATE_SUCCEEDED"' in stream
    final = json.loads(
        await run(
            grpcurl_call,
            grpcurl,
            address,
            "fleetshift.v1.Operations/GetOperation",
            {"operation_id": op["id"]},
        )
    )
    assert final["state"] == "OPERATION_STATE_SUCCEEDED"
    assert final["reason"] == "decode-heavy afternoon"
    assert all(s["state"] == "STEP_STATE_DONE" for s in final["steps"])
    # What each step made, as (node, role); which roles the plan picks depends on the arrival
    # rate the traffic window measured, i.e. on how fast this machine sent the traffic.
    made = {
        s.get("new_worker_id") or s["worker_id"]: (s["target_node"], s["target_role"])
        for s in final["steps"]
        if s["kind"] in ("STEP_KIND_START", "STEP_KIND_ROLE_CHANGE")
    }
    assert made, final["steps"]
    async with grpc.aio.insecure_channel(address) as daemon:
        # The executor records a role change as it makes it, and a heartbeat the agent polled
        # before the change (an older role_epoch) must not undo it: the new placement shows at
        # once and holds through the next heartbeats (one every 0.3 s).
        for _ in range(8):
            serving = await serving_workers(daemon)
            assert {w: serving.get(w) for w in made} == made, serving
            await asyncio.sleep(0.25)
