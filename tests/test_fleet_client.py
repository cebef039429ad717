"""The gRPC fleet client against real gRPC servers: refusals arrive as typed, readable errors.

The servers here are real grpc.aio servers with the real AgentService and WorkerService
interfaces; each method refuses with the status a test names, as an agent or worker would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from fleetshift.v1 import agent_pb2_grpc, worker_pb2_grpc
from fleetshift_common.errors import FailedPrecondition, FleetShiftError, Unavailable
from fleetshift_common.vocabulary import Role
from fleetshift_daemon.clients.fleet import GrpcFleetClient
from fleetshift_daemon.core.fleet_client import (
    AgentRef,
    SessionEnded,
    WorkerAlreadyRuns,
    WorkerGone,
    WorkerLaunch,
    WorkerRef,
)
from fleetshift_daemon.core.perfmodel import Dtype

REFUSALS: dict[str, grpc.StatusCode] = {}


async def _refuse(context: grpc.aio.ServicerContext, method: str) -> None:
    await context.abort(REFUSALS[method], f"{method} refused: worker w1 has no session s9")


class Agent(agent_pb2_grpc.AgentServiceServicer):
    async def StartWorker(self, request, context):  # type: ignore[no-untyped-def]
        await _refuse(context, "StartWorker")

    async def StopWorker(self, request, context):  # type: ignore[no-untyped-def]
        await _refuse(context, "StopWorker")


class Worker(worker_pb2_grpc.WorkerServiceServicer):
    async def ExportSession(self, request, context):  # type: ignore[no-untyped-def]
        await _refuse(context, "ExportSession")

    async def SetRole(self, request, context):  # type: ignore[no-untyped-def]
        await _refuse(context, "SetRole")


@pytest.fixture
async def peers() -> AsyncIterator[tuple[AgentRef, WorkerRef, GrpcFleetClient]]:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(Agent(), server)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcFleetClient(max_message_bytes=4 << 20)
    address = f"127.0.0.1:{port}"
    yield AgentRef("h100-a", address), WorkerRef("w1", address), client
    await client.close()
    await server.stop(0)


LAUNCH = WorkerLaunch("w-new", "llama-70b", "", Role.DECODE, 4, Dtype.BF16, (0, 1, 2, 3))


def one_sentence(err: FleetShiftError, peer: str) -> None:
    assert err.message.startswith(f"{peer}: "), err.message
    for wire_dump in ("\n", "debug_error_string", "AioRpcError", "StatusCode."):
        assert wire_dump not in err.message, err.message


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.ALREADY_EXISTS, WorkerAlreadyRuns),  # the phase machine retries
        (grpc.StatusCode.NOT_FOUND, FleetShiftError),  # passes with its meaning: NotFound
        (grpc.StatusCode.INTERNAL, FailedPrecondition),  # the agent's problem, not the caller's
    ],
)
async def test_an_agent_refusing_a_start(peers, code, expected) -> None:  # type: ignore[no-untyped-def]
    agent, _, client = peers
    REFUSALS["StartWorker"] = code
    with pytest.raises(expected) as err:
        await client.start_worker(agent, LAUNCH)
    one_sentence(err.value, "agent of node 'h100-a'")
    assert err.value.field == "node_name"


async def test_stopping_a_worker_the_agent_does_not_run_is_worker_gone(peers) -> None:  # type: ignore[no-untyped-def]
    agent, _, client = peers
    REFUSALS["StopWorker"] = grpc.StatusCode.NOT_FOUND
    with pytest.raises(WorkerGone):
        await client.stop_worker(agent, "w1")
    REFUSALS["StopWorker"] = grpc.StatusCode.UNAVAILABLE  # anything else is not "gone"
    with pytest.raises(FleetShiftError) as err:
        await client.stop_worker(agent, "w1")
    assert not isinstance(err.value, WorkerGone)


async def test_only_a_failed_precondition_means_the_session_ended(peers) -> None:  # type: ignore[no-untyped-def]
    _, worker, client = peers
    REFUSALS["ExportSession"] = grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(SessionEnded) as err:
        await client.export_session(worker, "s9", with_kv=True)
    one_sentence(err.value, "worker 'w1'")
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE):
        REFUSALS["ExportSession"] = code
        with pytest.raises(FleetShiftError) as other:
            await client.export_session(worker, "s9", with_kv=True)
        assert not isinstance(other.value, SessionEnded), code


async def test_an_unreachable_worker_is_one_readable_sentence() -> None:
    client = GrpcFleetClient(max_message_bytes=4 << 20)
    try:
        with pytest.raises(Unavailable) as err:
            await client.set_role(WorkerRef("w-gone", "127.0.0.1:1"), Role.MIXED)
    finally:
        await client.close()
    one_sentence(err.value, "worker 'w-gone'")
