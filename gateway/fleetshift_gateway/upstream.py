"""Serving one request on the fleet: Route, then the worker(s), following moves.

A mixed answer streams through ``routed_session`` (which re-routes a refused new session and
follows a moved one through ``follow_session``). A split answer runs the prompt on the prefill
worker until its first token, hands the session to the decode worker (ExportSession with its
KV, release; ImportSession) and follows it there from token 1, so the client sees one stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from fleetshift.v1 import placement_pb2, placement_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift_gateway.requests import Generation
from fleetshift_rpc.sessions import follow_session, routed_session, stub

ROUTE_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 << 20


class WorkerChannels:
    """One gRPC channel per worker endpoint, kept for the gateway's life: connecting afresh
    for every request would add a TCP and HTTP/2 handshake to each one's TTFT."""

    def __init__(self) -> None:
        self._open: dict[str, grpc.aio.Channel] = {}

    @asynccontextmanager
    async def lend(self, endpoint: str) -> AsyncIterator[grpc.aio.Channel]:
        channel = self._open.get(endpoint)
        if channel is None:
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            channel = self._open[endpoint] = grpc.aio.insecure_channel(endpoint, options=options)
        yield channel

    async def close(self) -> None:
        for channel in self._open.values():
            await channel.close()
        self._open.clear()


def generate_request(gen: Generation, session_id: str) -> worker_pb2.GenerateRequest:
    sampling = worker_pb2.WorkerSampling(temperature=gen.temperature, top_p=gen.top_p)
    if gen.seed is not None:
        sampling.seed = gen.seed
    return worker_pb2.GenerateRequest(
        prompt_tokens=gen.prompt,
        max_new_tokens=gen.limit,
        sampling=sampling,
        session_id=session_id,
    )


def route_request(gen: Generation) -> placement_pb2.RouteRequest:
    route = placement_pb2.RouteRequest(model=gen.model.name, prompt_tokens=len(gen.prompt))
    if gen.max_tokens is not None:
        route.expected_output_tokens = gen.max_tokens
    return route


async def serve(
    daemon: grpc.aio.Channel, channels: WorkerChannels, gen: Generation, session_id: str
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    route = route_request(gen)
    placement = stub(placement_pb2_grpc.PlacementStub, daemon)
    routed = await placement.Route(route, timeout=ROUTE_TIMEOUT_S)
    request = generate_request(gen, session_id)
    if routed.decode_endpoint and routed.decode_endpoint != routed.endpoint:
        async for msg in _split(daemon, channels, routed, request):
            yield msg
        return
    route.reroute = True  # the Route above already counted this request in the traffic mix
    async for msg in routed_session(
        daemon, route, request, endpoint=routed.endpoint, channel_for=channels.lend
    ):
        yield msg


async def _split(
    daemon: grpc.aio.Channel,
    channels: WorkerChannels,
    routed: placement_pb2.RouteResponse,
    request: worker_pb2.GenerateRequest,
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    sid = request.session_id
    async with channels.lend(routed.endpoint) as ch:
        prefill = stub(worker_pb2_grpc.WorkerServiceStub, ch)
        call = prefill.Generate(request)
        received = 0
        async for msg in call:
            received = msg.index + 1
            yield msg
            if msg.finished:
                return
            try:
                exported = await prefill.ExportSession(
                    worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True, release=True),
                    timeout=30,
                )
            except grpc.aio.AioRpcError:
                continue  # it finished meanwhile, or cannot leave: the prefill worker ends it
            call.cancel()
            break
        else:
            return
    async with channels.lend(routed.decode_endpoint) as ch:
        await stub(worker_pb2_grpc.WorkerServiceStub, ch).ImportSession(
            worker_pb2.ImportSessionRequest(blob=exported.blob), timeout=30
        )
    resume = worker_pb2.GenerateRequest(resume_session_id=sid, resume_from_token=received)
    async for msg in follow_session(
        daemon, routed.decode_endpoint, resume, channel_for=channels.lend
    ):
        yield msg
