"""The registry API over real gRPC on loopback: what agents and operators see."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc

GiB = 1024**3


def registration(
    name: str = "node-a", memory: int = 80 * GiB, gpus: int = 2
) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(
        node_name=name,
        agent_address="127.0.0.1:50052",
        gpus=[
            pb.Gpu(
                index=i,
                product_name="NVIDIA H100 80GB HBM3",
                memory_bytes=memory,
                compute_capability="9.0",
            )
            for i in range(gpus)
        ],
        versions=pb.NodeVersions(driver="550.54", cuda="12.4", torch="2.13.0", agent="0.1.0"),
        inventory_source=pb.INVENTORY_SOURCE_DECLARED,
    )


@pytest.fixture
async def stubs(daemon):  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        yield pb_grpc.AgentRegistryStub(ch), pb_grpc.FleetOperatorStub(ch)


async def test_register_list_get_and_cordon(stubs) -> None:  # type: ignore[no-untyped-def]
    agents, operator = stubs
    reply = await agents.RegisterNode(registration())
    assert reply.created and reply.heartbeat_interval_ms == 200
    again = await agents.RegisterNode(registration())
    assert not again.created
    nodes = (await operator.ListNodes(pb.ListNodesRequest())).nodes
    assert [n.name for n in nodes] == ["node-a"]
    assert nodes[0].state == pb.NODE_STATE_READY
    assert nodes[0].inventory_source == pb.INVENTORY_SOURCE_DECLARED
    assert len(nodes[0].gpus) == 2 and nodes[0].gpus[1].memory_bytes == 80 * GiB

    cordoned = await operator.CordonNode(pb.CordonNodeRequest(node_name="node-a", reason="disk"))
    assert cordoned.cordoned and cordoned.cordon_reason == "disk"
    assert (await agents.Heartbeat(pb.HeartbeatRequest(node_name="node-a"))).cordoned
    node = await operator.GetNode(pb.GetNodeRequest(node_name="node-a"))
    assert node.cordoned
    assert not (await operator.UncordonNode(pb.UncordonNodeRequest(node_name="node-a"))).cordoned

    filtered = await operator.ListNodes(pb.ListNodesRequest(gpu_product_contains="h200"))
    assert list(filtered.nodes) == []


async def test_silent_node_turns_lost_then_ready_again(stubs) -> None:  # type: ignore[no-untyped-def]
    agents, operator = stubs
    await agents.RegisterNode(registration())
    await asyncio.sleep(1.6)  # timeout 1.0 s, sweep every 0.1 s
    lost = await operator.ListNodes(pb.ListNodesRequest(state=pb.NODE_STATE_LOST))
    assert [n.name for n in lost.nodes] == ["node-a"]
    reply = await agents.Heartbeat(pb.HeartbeatRequest(node_name="node-a"))
    assert reply.state == pb.NODE_STATE_READY
    node = await operator.GetNode(pb.GetNodeRequest(node_name="node-a"))
    assert node.state == pb.NODE_STATE_READY


BAD_REGISTRATIONS = [
    (registration(name=""), "node_name"),
    (registration(name="n" * 64), "node_name"),
    (registration(name="bad name!"), "node_name"),
    (registration(memory=-1), "gpus[0].memory_bytes"),
    (registration(memory=10 * 1024**5), "gpus[0].memory_bytes"),
    (registration(gpus=0), "gpus"),
    (
        pb.RegisterNodeRequest(node_name="x", agent_address="nope", gpus=registration().gpus),
        "agent_address",
    ),
]


@pytest.mark.parametrize(("request_msg", "field"), BAD_REGISTRATIONS)
async def test_bad_registration_is_refused_by_field(stubs, request_msg, field) -> None:  # type: ignore[no-untyped-def]
    agents, operator = stubs
    await agents.RegisterNode(registration(name="keep-me"))
    before = await operator.ListNodes(pb.ListNodesRequest())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agents.RegisterNode(request_msg)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    after = await operator.ListNodes(pb.ListNodesRequest())
    assert [n.name for n in after.nodes] == [n.name for n in before.nodes] == ["keep-me"]
    assert after.nodes[0].gpus == before.nodes[0].gpus


async def test_unknown_nodes_are_not_found(stubs) -> None:  # type: ignore[no-untyped-def]
    agents, operator = stubs
    calls = [
        agents.Heartbeat(pb.HeartbeatRequest(node_name="ghost")),
        operator.CordonNode(pb.CordonNodeRequest(node_name="ghost")),
        operator.UncordonNode(pb.UncordonNodeRequest(node_name="ghost")),
        operator.GetNode(pb.GetNodeRequest(node_name="ghost")),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "ghost" in err.value.details()
    assert list((await operator.ListNodes(pb.ListNodesRequest())).nodes) == []


async def test_cordon_with_empty_name_is_invalid(stubs) -> None:  # type: ignore[no-untyped-def]
    _, operator = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await operator.CordonNode(pb.CordonNodeRequest(node_name=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "node_name" in err.value.details()


async def test_message_over_the_size_limit_is_refused(stubs) -> None:  # type: ignore[no-untyped-def]
    agents, operator = stubs
    huge = registration()
    huge.versions.agent = "x" * (128 * 1024)  # the fixture's limit is 64 KiB
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agents.RegisterNode(huge)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list((await operator.ListNodes(pb.ListNodesRequest())).nodes) == []
