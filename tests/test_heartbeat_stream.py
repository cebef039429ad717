"""Heartbeats over one HeartbeatStream call, against a real daemon: what unary Heartbeat does.

The agent sends every heartbeat to every daemon replica on a call it keeps open
(``fleetshift_rpc.heartbeat_stream``). Each must be answered as unary Heartbeat answers it,
and a heartbeat Heartbeat refuses must end that call with the same status and change nothing,
so the agent's reactions (register again on NOT_FOUND, resend without finished sessions on
their INVALID_ARGUMENT) work unchanged; the next heartbeat opens a new call.
"""

from __future__ import annotations

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2
from fleetshift.v1 import placement_pb2_grpc as placement_grpc
from fleetshift_rpc.heartbeat_stream import HeartbeatSender

from .test_registry_api import registration


def worker(n: int) -> pb.WorkerStatus:
    return pb.WorkerStatus(
        worker_id=f"w{n}",
        model="llama-70b",
        role=pb.WORKER_ROLE_MIXED,
        tensor_parallel=1,
        dtype="bf16",
        gpu_indices=[0],
        endpoint="127.0.0.1:9001",
        state=pb.WORKER_STATE_SERVING,
    )


async def test_heartbeats_share_one_call_and_are_answered_as_unary_heartbeat(daemon) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        agents = pb_grpc.AgentRegistryStub(ch)
        await agents.RegisterNode(registration("node-s"))
        sender = HeartbeatSender(ch)
        for _ in range(20):
            reply = await sender.send(pb.HeartbeatRequest(node_name="node-s"), timeout=5)
            assert reply.state == pb.NODE_STATE_READY and not reply.cordoned
        await pb_grpc.FleetOperatorStub(ch).CordonNode(pb.CordonNodeRequest(node_name="node-s"))
        reply = await sender.send(pb.HeartbeatRequest(node_name="node-s"), timeout=5)
        assert reply.cordoned  # the answer reads the registry now, as unary Heartbeat's does
        unary = await agents.Heartbeat(pb.HeartbeatRequest(node_name="node-s"))
        assert unary == reply
        sender.close()
    assert sender.calls_opened == 1 and not sender.unary


async def test_an_unknown_node_ends_the_call_with_not_found_and_the_next_opens_anew(
    daemon,  # type: ignore[no-untyped-def]
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        sender = HeartbeatSender(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.send(pb.HeartbeatRequest(node_name="ghost"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "ghost" in (err.value.details() or "")
        # What the agent does next: register, heartbeat on (a new call).
        await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("ghost"))
        reply = await sender.send(pb.HeartbeatRequest(node_name="ghost"), timeout=5)
        assert reply.state == pb.NODE_STATE_READY
        sender.close()
    assert sender.calls_opened == 2 and not sender.unary


async def test_a_heartbeat_past_a_bound_is_refused_by_field_and_changes_nothing(
    daemon,  # type: ignore[no-untyped-def]
) -> None:
    """The interceptor that checks a unary request's bounds sees a stream's messages only as
    bytes: the stream checks each message itself, with the same error."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("node-b"))
        sender = HeartbeatSender(ch)
        too_many = pb.HeartbeatRequest(node_name="node-b", workers=[worker(n) for n in range(257)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sender.send(too_many, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "workers" in (err.value.details() or "")
        listed = await placement_grpc.PlanningStub(ch).ListWorkers(
            placement_pb2.ListWorkersRequest()
        )
        assert list(listed.workers) == []  # none of the 257 was taken
        reply = await sender.send(pb.HeartbeatRequest(node_name="node-b"), timeout=5)
        assert reply.state == pb.NODE_STATE_READY  # the node heartbeats on, on a new call
        sender.close()
