"""Heartbeats never rebuild the router's index; Route still sees what they report.

Registering N nodes used to cost N rebuilds of the whole index (O(fleet) each): each new node's
first heartbeat adopted its workers, which staled the index, and the heartbeat rebuilt it at
once. With 1,000 nodes that took 518 s on one loaded core (docs/benchmarks.md). The rebuild
now waits for the next Route, which reads the counters the heartbeats stored. Real daemon,
real gRPC agents' calls, real SQLite.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.config import DaemonConfig, ModelConfig
from fleetshift_daemon.app import Daemon

GiB = 1024**3
MODEL = "llama-70b"
NODES = 40
FAST = 7


def beat(n: int, queue: int = 0) -> fpb.HeartbeatRequest:
    name = f"node-{n:03d}"
    workers = [
        fpb.WorkerStatus(
            worker_id=f"{name}-w{k}", model=MODEL, role=fpb.WORKER_ROLE_MIXED, tensor_parallel=4,
            gpu_indices=list(range(4 * k, 4 * k + 4)), endpoint=f"10.0.0.{n}:{9000 + k}",
            state=fpb.WORKER_STATE_SERVING,
            counters=fpb.WorkerCounters(
                worker_id=f"{name}-w{k}", kv_blocks_total=50_000, queue_depth=queue
            ),
        )
        for k in range(2)
    ]  # fmt: skip
    return fpb.HeartbeatRequest(node_name=name, workers=workers)


@pytest.fixture
async def counted(tmp_path: Path, sqlite_url: str) -> AsyncIterator[tuple[Daemon, list[int]]]:
    """A daemon whose index rebuilds are counted."""
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        heartbeat_interval_s=1.0,
        node_lost_after_s=600.0,
        models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4, 8)),),
    )
    daemon = Daemon(config)
    await daemon.start()
    rebuilds = [0]
    rebuild = daemon.placement.refresh_fleet

    def counting() -> None:
        rebuilds[0] += 1
        rebuild()

    daemon.placement.refresh_fleet = counting  # type: ignore[method-assign]
    try:
        yield daemon, rebuilds
    finally:
        await daemon.stop(0.1)


async def register(agents: fpb_grpc.AgentRegistryStub, n: int) -> None:
    product = "NVIDIA H200" if n == FAST else "NVIDIA H100 80GB HBM3"
    gpus = [fpb.Gpu(index=i, product_name=product, memory_bytes=80 * GiB) for i in range(8)]
    await agents.RegisterNode(
        fpb.RegisterNodeRequest(node_name=f"node-{n:03d}", agent_address="127.0.0.1:1", gpus=gpus)
    )


async def test_registering_a_fleet_costs_one_rebuild_and_route_sees_the_heartbeats(
    counted: tuple[Daemon, list[int]],
) -> None:
    daemon, rebuilds = counted
    fast = f"node-{FAST:03d}"  # the one H200 node: its two workers are a class of their own
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        placement = pb_grpc.PlacementStub(ch)
        for n in range(NODES):
            await register(agents, n)
            await agents.Heartbeat(beat(n))
        assert rebuilds[0] == 0  # was one per node: each first heartbeat adopts two workers
        request = pb.RouteRequest(model=MODEL, prompt_tokens=2000, expected_output_tokens=100)
        assert (await placement.Route(request)).node_name == fast  # idle and the fastest
        assert rebuilds[0] == 1
        # The H200 node's heartbeat reports a deep queue: Route learns it from the heartbeat
        # alone (no rebuild) and sends the request elsewhere.
        await agents.Heartbeat(beat(FAST, queue=500_000))
        assert (await placement.Route(request)).node_name != fast
        assert rebuilds[0] == 1
        # A change that does stale the index (a new node's workers), then the queue drains:
        # the rebuild at the next Route reads the queue the last heartbeat stored.
        await register(agents, NODES)
        await agents.Heartbeat(beat(NODES))
        await agents.Heartbeat(beat(FAST, queue=0))
        assert (await placement.Route(request)).node_name == fast
        assert rebuilds[0] == 2
