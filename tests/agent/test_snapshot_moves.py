"""Snapshot a worker on one agent, pull it to another, start a worker there from it.

Three agents with declared inventories (two H100 nodes, one H200 node) on one daemon, all
in this process; their workers are real processes on the tiny model.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import (
    agent_pb2,
    placement_pb2,
    placement_pb2_grpc,
    snapshot_pb2,
    snapshot_pb2_grpc,
    worker_pb2,
)
from fleetshift.v1 import fleet_pb2 as pb

from .fleet import (
    H100,
    H200,
    agent_config,
    agent_stub,
    eventually,
    paused_session,
    running_agent,
    start_request,
    worker_info,
    worker_stub,
)

pytestmark = pytest.mark.slow
KEY_FIELDS = [f.name for f in worker_pb2.WorkerCompatKey.DESCRIPTOR.fields]


async def _greedy(endpoint: str, n: int = 8) -> list[int]:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stream = worker_stub(ch).Generate(
            worker_pb2.GenerateRequest(prompt_tokens=[3, 1, 4, 1, 5], max_new_tokens=n)
        )
        return [msg.token async for msg in stream]


async def _snapshots(address: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await snapshot_pb2_grpc.SnapshotServiceStub(ch).ListSnapshots(
            snapshot_pb2.ListSnapshotsRequest()
        )
    return {s.snapshot_id: s.size_bytes for s in reply.snapshots}


async def test_snapshot_fetch_and_warm_start_on_another_node(
    daemon: object, tiny_model: Path, tmp_path: Path
) -> None:
    port = daemon.port  # type: ignore[attr-defined]
    async with AsyncExitStack() as stack:
        addr = {}
        for name, product in (("a", H100), ("b", H100), ("c", H200)):
            config = agent_config(port, f"node-{name}", tmp_path / name, product=product)
            agent = await stack.enter_async_context(running_agent(config))
            addr[name] = f"127.0.0.1:{agent.port}"
        chans = [grpc.aio.insecure_channel(addr[x]) for x in "abc"]
        for ch in chans:
            stack.push_async_callback(ch.close)
        sa, sb, sc = (agent_stub(ch) for ch in chans)

        source = await sa.StartWorker(start_request("src", tiny_model), timeout=120)
        async with grpc.aio.insecure_channel(source.endpoint) as wch:
            worker = worker_stub(wch)
            stream, _ = await paused_session(worker, "live-1", tokens=30, steps=2)
            snap = await sa.SnapshotWorker(
                agent_pb2.SnapshotWorkerRequest(worker_id="src", snapshot_id="snap-1")
            )
            await worker.Resume(worker_pb2.WorkerResumeRequest())
            stream.cancel()  # type: ignore[attr-defined]
        assert list(snap.session_ids) == ["live-1"] and snap.size_bytes > 0
        held = await _snapshots(addr["a"])
        assert list(held) == ["snap-1"]

        fetched = await sb.FetchSnapshot(
            agent_pb2.FetchSnapshotRequest(source_agent_address=addr["a"], snapshot_id="snap-1")
        )
        assert fetched.bytes_received > 0 and fetched.size_bytes == held["snap-1"]
        assert await _snapshots(addr["b"]) == held
        again = await sb.FetchSnapshot(
            agent_pb2.FetchSnapshotRequest(source_agent_address=addr["a"], snapshot_id="snap-1")
        )
        assert again.bytes_received == 0 and again.size_bytes == fetched.size_bytes

        warm = await sb.StartWorker(start_request("warm", snapshot_id="snap-1"), timeout=120)
        assert warm.origin_snapshot == "snap-1" and warm.state == pb.WORKER_STATE_SERVING
        src_info, warm_info = await worker_info(source.endpoint), await worker_info(warm.endpoint)
        assert warm_info.compat_key == src_info.compat_key  # two declared H100s: one key
        assert src_info.compat_key.gpu_product == "NVIDIA H100 80GB HBM3 (declared)"
        assert warm_info.restored_from == "snap-1"
        assert list(warm_info.session_ids) == []  # sessions move one by one, not with it

        await sc.FetchSnapshot(
            agent_pb2.FetchSnapshotRequest(source_agent_address=addr["a"], snapshot_id="snap-1")
        )
        cold = await sc.StartWorker(start_request("cold", snapshot_id="snap-1"), timeout=120)
        cold_info = await worker_info(cold.endpoint)
        differ = [
            f
            for f in KEY_FIELDS
            if getattr(cold_info.compat_key, f) != getattr(src_info.compat_key, f)
        ]
        assert differ == ["gpu_product"]
        assert cold_info.compat_key.gpu_product == "NVIDIA H200 (declared)"
        assert list(cold_info.session_ids) == []

        # Same weights everywhere: the same greedy continuation from all three workers.
        reference = await _greedy(source.endpoint)
        assert await _greedy(warm.endpoint) == reference
        assert await _greedy(cold.endpoint) == reference

        async def listed() -> dict[str, pb.WorkerStatus]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = await placement_pb2_grpc.PlanningStub(ch).ListWorkers(
                    placement_pb2.ListWorkersRequest()
                )
            return {w.worker_id: w for w in reply.workers}

        workers = await eventually(listed, lambda w: {"src", "warm", "cold"} <= set(w))
        assert workers["warm"].origin_snapshot == "snap-1"
        assert workers["src"].origin_snapshot == ""
