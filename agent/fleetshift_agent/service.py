"""The agent's own gRPC API (``AgentService``), called by the daemon and by other agents.

Later capabilities (workers, snapshots, transfers) add their servicers beside this one; this
one answers what the node is and whether it currently holds a registration.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc
from fleetshift.v1 import fleet_pb2 as fleet_pb
from fleetshift_rpc.errors import rpc_errors
from fleetshift_rpc.server import ServiceBinding


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, info: Callable[[], agent_pb2.AgentInfo]) -> None:
        self._info = info

    @rpc_errors
    async def GetAgentInfo(
        self, request: agent_pb2.GetAgentInfoRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.AgentInfo:
        return self._info()


def binding(info: Callable[[], agent_pb2.AgentInfo]) -> ServiceBinding:
    return ServiceBinding(
        agent_pb2_grpc.add_AgentServiceServicer_to_server,
        AgentServicer(info),
        agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    )


__all__ = ["AgentServicer", "binding", "fleet_pb"]
