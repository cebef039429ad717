"""Servicers of the fleet registry API: thin adapters over ``core.registry.Registry``.

Calls that write to the store run in a worker thread so a slow disk or database never stalls
the event loop that also serves heartbeats; heartbeats themselves touch only memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.api import convert
from fleetshift_daemon.core.placement import PlacementService
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.core.workers import WorkerTable
from fleetshift_rpc.errors import rpc_errors
from fleetshift_rpc.metrics import DaemonMetrics
from fleetshift_rpc.security import require_node_identity
from fleetshift_rpc.server import ServiceBinding
from fleetshift_rpc.validation import check_request

log = logging.getLogger("fleetshift.daemon.api")


class AgentRegistryServicer(pb_grpc.AgentRegistryServicer):
    def __init__(
        self,
        registry: Registry,
        heartbeat_interval_ms: int,
        metrics: DaemonMetrics | None = None,
        workers: WorkerTable | None = None,
        placement: PlacementService | None = None,
        acting: Callable[[], bool] = lambda: True,
    ) -> None:
        self._acting = acting  # False on a follower replica: it keeps a view, decides nothing
        self._placement = placement
        self._registry = registry
        self._heartbeat_interval_ms = heartbeat_interval_ms
        self._metrics = metrics
        self._workers = workers

    @rpc_errors
    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNodeResponse:
        require_node_identity(request.node_name)  # node A's certificate cannot speak for B
        node, created = await asyncio.to_thread(
            self._registry.register, convert.registration(request)
        )
        return pb.RegisterNodeResponse(
            node=convert.node_pb(node),
            heartbeat_interval_ms=self._heartbeat_interval_ms,
            created=created,
        )

    @rpc_errors
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        return self._heartbeat(request)

    @rpc_errors
    async def HeartbeatStream(
        self, requests: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        """Each heartbeat of the call answered as unary Heartbeat answers it, in order. One
        Heartbeat would refuse ends the call with Heartbeat's status: the agent acts on it as
        on a unary refusal (registers again on NOT_FOUND, drops finished sessions on their
        INVALID_ARGUMENT) and opens a new call. Bounds are checked here, per message: the
        RequestBounds interceptor sees a stream's messages only as they decode. The headers
        go out at once, so the agent can tell this from a daemon without the method."""
        await context.send_initial_metadata(())
        async for request in requests:
            check_request(request)
            yield self._heartbeat(request)

    def _heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """One heartbeat, however it came; memory only (no store write, no await)."""
        require_node_identity(request.node_name)
        reports = [convert.worker_report(w, f"workers[{i}]") for i, w in enumerate(request.workers)]
        if self._placement is not None:  # a bad finished session refuses it all, first
            self._placement.check_finished(reports)
        previous = self._registry.last_heartbeat(request.node_name)
        counters = [r.counters for r in reports if r.counters is not None]
        acting = self._acting()
        node = self._registry.heartbeat(request.node_name, counters, record=acting)
        if self._workers is not None and not acting:
            self._workers.observe(request.node_name, reports)  # the leader reconciles
        elif self._workers is not None:
            for worker_id in self._workers.reconcile(request.node_name, reports):
                log.error("worker vanished from its node", extra={"worker": worker_id})
        if self._placement is not None:
            self._placement.observe_heartbeat(node)
            # Every replica learns output lengths from the heartbeats it hears (each answers
            # Route with its own estimator); repeats are counted once.
            self._placement.observe_finished(reports)
        if self._metrics is not None and previous is not None and node.last_heartbeat_at:
            self._metrics.observe_heartbeat(node.last_heartbeat_at - previous)
        return pb.HeartbeatResponse(state=convert.node_state_pb(node.state), cordoned=node.cordoned)


class FleetOperatorServicer(pb_grpc.FleetOperatorServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    @rpc_errors
    async def ListNodes(
        self, request: pb.ListNodesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNodesResponse:
        state = None
        if request.state != pb.NODE_STATE_UNSPECIFIED:
            if request.state not in convert.STATE_FROM_PB:
                raise InvalidArgument(f"state {request.state} is not a node state", field="state")
            state = convert.STATE_FROM_PB[request.state]
        nodes = self._registry.nodes(state, request.gpu_product_contains)
        return pb.ListNodesResponse(nodes=[convert.node_pb(n) for n in nodes])

    @rpc_errors
    async def GetNode(
        self, request: pb.GetNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.Node:
        return convert.node_pb(self._registry.get(request.node_name))

    @rpc_errors
    async def CordonNode(
        self, request: pb.CordonNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.Node:
        node = await asyncio.to_thread(
            self._registry.set_cordon, request.node_name, True, request.reason
        )
        return convert.node_pb(node)

    @rpc_errors
    async def UncordonNode(
        self, request: pb.UncordonNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.Node:
        node = await asyncio.to_thread(self._registry.set_cordon, request.node_name, False)
        return convert.node_pb(node)


def bindings(
    registry: Registry,
    heartbeat_interval_ms: int,
    metrics: DaemonMetrics | None = None,
    workers: WorkerTable | None = None,
    placement: PlacementService | None = None,
    acting: Callable[[], bool] = lambda: True,
) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            pb_grpc.add_AgentRegistryServicer_to_server,
            AgentRegistryServicer(
                registry, heartbeat_interval_ms, metrics, workers, placement, acting
            ),
            pb.DESCRIPTOR.services_by_name["AgentRegistry"].full_name,
        ),
        ServiceBinding(
            pb_grpc.add_FleetOperatorServicer_to_server,
            FleetOperatorServicer(registry),
            pb.DESCRIPTOR.services_by_name["FleetOperator"].full_name,
        ),
    ]
