"""Restores that say what they did, and refuse what is not theirs (issue 13 items 2 and 11).

Two agents with declared inventories (an H100 node and an H200 node) on a real daemon, real
worker processes on the tiny model: a snapshot taken on the H100 node restores warm there and
with its weights but recomputed KV on the H200 node, and both StartWorker replies say so;
CheckCompatibility answers "would it restore on this node?" by node name; a snapshot with a file
its manifest does not list is refused by StartWorker, naming the file.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2, snapshot_pb2, snapshot_pb2_grpc

from .fleet import H100, H200, agent_config, agent_stub, running_agent, start_request

pytestmark = pytest.mark.slow


def check(snapshot_id: str, node: str, source: str = "") -> snapshot_pb2.CheckCompatibilityRequest:
    return snapshot_pb2.CheckCompatibilityRequest(
        snapshot_id=snapshot_id, node_name=node, source_agent_address=source
    )


async def test_restores_report_their_verdict_and_refuse_unlisted_files(
    daemon: object, tiny_model: Path, tmp_path: Path
) -> None:
    port = daemon.port  # type: ignore[attr-defined]
    async with AsyncExitStack() as stack:
        addr = {}
        for name, product in (("h100", H100), ("h200", H200)):
            config = agent_config(port, f"node-{name}", tmp_path / name, product=product)
            agent = await stack.enter_async_context(running_agent(config))
            addr[name] = f"127.0.0.1:{agent.port}"
        ch100 = await stack.enter_async_context(grpc.aio.insecure_channel(addr["h100"]))
        ch200 = await stack.enter_async_context(grpc.aio.insecure_channel(addr["h200"]))
        a100, a200 = agent_stub(ch100), agent_stub(ch200)
        s100 = snapshot_pb2_grpc.SnapshotServiceStub(ch100)
        s200 = snapshot_pb2_grpc.SnapshotServiceStub(ch200)

        await a100.StartWorker(start_request("src", tiny_model), timeout=120)
        await a100.SnapshotWorker(
            agent_pb2.SnapshotWorkerRequest(worker_id="src", snapshot_id="snap-1")
        )

        # "Would it restore here?", by node name: warm on its own node ...
        here = await s100.CheckCompatibility(check("snap-1", "node-h100"))
        assert here.warm_ok and list(here.differences) == []
        # ... and, asked of the H200 node's agent with the snapshot still on the H100 node,
        # weights yes, KV no, naming the field, before a byte is transferred.
        there = await s200.CheckCompatibility(check("snap-1", "node-h200", addr["h100"]))
        assert not there.warm_ok and there.weights_reusable
        assert [d.field for d in there.differences] == ["gpu_product"]
        assert there.differences[0].destination == "NVIDIA H200 (declared)"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s200.CheckCompatibility(check("snap-1", "node-h100"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "node_name" in err.value.details()

        warm = await a100.StartWorker(
            start_request("warm", gpus=(1,), snapshot_id="snap-1"), timeout=120
        )
        assert warm.restore_compat.startswith("warm restore")

        await a200.FetchSnapshot(
            agent_pb2.FetchSnapshotRequest(source_agent_address=addr["h100"], snapshot_id="snap-1")
        )
        cold = await a200.StartWorker(start_request("cold", snapshot_id="snap-1"), timeout=120)
        assert cold.restore_compat.startswith("weights kept, KV recomputed")
        assert (
            "gpu_product" in cold.restore_compat and "NVIDIA H200 (declared)" in cold.restore_compat
        )

        # A file the manifest does not list: refused before any worker starts, naming it.
        (tmp_path / "h200" / "snapshots" / "snap-1" / "tensors" / "evil.py").write_text("x = 1\n")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await a200.StartWorker(
                start_request("tampered", gpus=(1,), snapshot_id="snap-1"), timeout=120
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tensors/evil.py" in err.value.details()
        assert "not listed in the manifest" in err.value.details()
        info = await a200.GetAgentInfo(agent_pb2.GetAgentInfoRequest())
        assert sorted(w.worker_id for w in info.workers) == ["cold"]
