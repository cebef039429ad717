"""Serving one request on the fleet: Route, then the worker(s), following moves.

A mixed answer streams through ``routed_session`` (which re-routes a refused new session and
follows a moved one through ``follow_session``). A split answer runs the prompt on the prefill
worker until its first token, hands the session to the decode worker (ExportSession with its
KV, release; ImportSession) and follows it there from token 1, so the client sees one stream;
a decode worker that refuses the hand-over (no KV to spare) leaves the session to decode on the
prefill worker instead (``_Split``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from fleetshift.v1 import placement_pb2, worker_pb2, worker_pb2_grpc
from fleetshift_gateway.requests import Generation
from fleetshift_gateway.routes import ROUTE_TIMEOUT_S, Router
from fleetshift_rpc.route_stream import route_client
from fleetshift_rpc.sessions import each_token, follow_session, routed_session, stub

log = logging.getLogger("fleetshift.gateway")

MAX_MESSAGE_BYTES = 64 << 20
# Tokens a worker may pack into one message for the gateway: those it already has (it never
# waits for more), so a burst (vLLM's --stream-interval, a worker catching up after a move)
# costs one message, not one each. The client's stream is the same, one event per token.
TOKENS_PER_MESSAGE = 16


class WorkerChannels:
    """One gRPC channel per worker endpoint, kept for the gateway's life: connecting afresh
    for every request would add a TCP and HTTP/2 handshake to each one's TTFT. On a fleet with
    TLS, workers take sessions only from identities their node lists (``worker_session_callers``,
    routers by default), so the channels carry the gateway's router certificate."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._open: dict[str, grpc.aio.Channel] = {}
        self._credentials = credentials

    @asynccontextmanager
    async def lend(self, endpoint: str) -> AsyncIterator[grpc.aio.Channel]:
        channel = self._open.get(endpoint)
        if channel is None:
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            channel = self._open[endpoint] = (
                grpc.aio.insecure_channel(endpoint, options=options)
                if self._credentials is None
                else grpc.aio.secure_channel(endpoint, self._credentials, options=options)
            )
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
        tokens_per_message=TOKENS_PER_MESSAGE,
    )


def route_request(gen: Generation) -> placement_pb2.RouteRequest:
    route = placement_pb2.RouteRequest(model=gen.model.name, prompt_tokens=len(gen.prompt))
    if gen.max_tokens is not None:
        route.expected_output_tokens = gen.max_tokens
    return route


# A hand-over refused with one of these never reached the target's engine: nothing to undo.
_REFUSED_CLEANLY = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)

# Called with (target endpoint, refusal) each time a split hand-over falls back.
OnRefused = Callable[[str, grpc.aio.AioRpcError], None]


async def serve(
    router: Router,
    channels: WorkerChannels,
    gen: Generation,
    session_id: str,
    on_refused: OnRefused | None = None,
    on_routed: Callable[[], None] | None = None,
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """The request's tokens from the worker(s) its route names (``on_routed`` is called once
    the route is known, for the response's Server-Timing). A route answered from the
    router's kept answers owes the daemon a counted Route call: sent once the first token has
    gone out (its ~0.5 ms of gRPC call set-up would otherwise delay it), and awaited before
    the last one goes out."""
    route = route_request(gen)
    routed = await router.route(route)
    if on_routed is not None:
        on_routed()
    route.reroute = True  # counted once (now, or by the owed call): later Routes are re-routes
    tokens = _tokens(router.daemon, channels, route, routed.answer, gen, session_id, on_refused)
    if routed.owed is None:
        async for msg in tokens:
            yield msg
        return
    counted: asyncio.Task[None] | None = None
    try:
        async for msg in tokens:
            if msg.finished:
                counted = counted or router.count(routed.owed)
                await asyncio.shield(counted)
            yield msg  # resumed once the token is out: the owed call is sent after it
            if counted is None:
                counted = router.count(routed.owed)
    finally:
        if counted is None:  # ended before its second token (client gone, worker failed):
            router.count(routed.owed)  # still a request the daemon counts, as before


def _tokens(
    daemon: grpc.aio.Channel,
    channels: WorkerChannels,
    route: placement_pb2.RouteRequest,
    routed: placement_pb2.RouteResponse,
    gen: Generation,
    session_id: str,
    on_refused: OnRefused | None,
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    request = generate_request(gen, session_id)
    if routed.decode_endpoint and routed.decode_endpoint != routed.endpoint:
        split = _Split(daemon, channels, route, on_refused or (lambda _e, _r: None))
        return split.serve(routed, request)
    return routed_session(
        daemon, route, request, endpoint=routed.endpoint, channel_for=channels.lend
    )


@dataclass
class _Split:
    """One split answer: prompt on the prefill worker, the rest on the decode worker.

    The hand-over moves the session (ExportSession with its KV, released at once so the
    prefill worker stops decoding it). A decode worker that refuses it (its KV full: "KV
    cache needs 17 more blocks, 10 free", draining, gone) must not cost the client its
    stream: the same blob goes back to the prefill worker, whose blocks it freed a moment
    ago, and the session decodes there as a colocated one; should that fail too, the
    workers of a fresh Route are tried. The blob holds every token so far and the sampler's
    state, so wherever it lands the stream resumes at the next token, none lost or repeated.
    """

    daemon: grpc.aio.Channel
    channels: WorkerChannels
    route: placement_pb2.RouteRequest  # marked reroute: a second Route is not a new request
    on_refused: OnRefused

    async def serve(
        self, routed: placement_pb2.RouteResponse, request: worker_pb2.GenerateRequest
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        sid, received = request.session_id, 0
        exported: worker_pb2.ExportSessionResponse | None = None
        first = worker_pb2.GenerateRequest()
        first.CopyFrom(request)
        first.hold_after_tokens = 1  # the prefill worker waits for the export, not runs ahead
        async with self.channels.lend(routed.endpoint) as ch:
            prefill = stub(worker_pb2_grpc.WorkerServiceStub, ch)
            call = prefill.Generate(first)
            try:
                async for msg in each_token(call):
                    received = msg.index + 1
                    yield msg
                    if msg.finished:
                        return
                    if exported is not None:
                        continue
                    exported = await self._export(prefill, sid, routed.endpoint, received)
                    if exported.blob:
                        call.cancel()
                        break
                else:
                    return
            except grpc.aio.AioRpcError as err:
                if received or err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # Refused before its first token (stopped by a move or a scale-down, draining):
                # the session never existed there, so it is routed afresh, as a colocated one.
                self.on_refused(routed.endpoint, err)
                async for msg in routed_session(
                    self.daemon, self.route, request, channel_for=self.channels.lend
                ):
                    yield msg
                return
        endpoint = await self._place(sid, exported.blob, [routed.decode_endpoint, routed.endpoint])
        resume = worker_pb2.GenerateRequest(
            resume_session_id=sid,
            resume_from_token=received,
            tokens_per_message=request.tokens_per_message,
        )
        async for msg in follow_session(
            self.daemon, endpoint, resume, channel_for=self.channels.lend
        ):
            yield msg

    async def _export(
        self, prefill: worker_pb2_grpc.WorkerServiceStub, sid: str, endpoint: str, received: int
    ) -> worker_pb2.ExportSessionResponse:
        """The session with its KV, released by the prefill worker; an empty answer when it
        finished meanwhile or cannot leave: the prefill worker then serves it to its end
        (asked once: a refusal per token would double every step's work)."""
        try:
            exported: worker_pb2.ExportSessionResponse = await prefill.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True, release=True),
                timeout=30,
            )
            return exported
        except grpc.aio.AioRpcError as err:
            log.info(
                "session %s stays on prefill worker %s after %d tokens: export refused (%s: %s)",
                sid,
                endpoint,
                received,
                err.code().name,
                err.details(),
            )
            return worker_pb2.ExportSessionResponse()

    async def _place(self, sid: str, blob: bytes, preferred: list[str]) -> str:
        """The endpoint that took the session: the first of ``preferred`` that imports it,
        else one a fresh Route names."""
        tried: list[str] = []
        refusal: grpc.aio.AioRpcError | None = None
        candidates = list(preferred)
        while candidates:
            endpoint = candidates.pop(0)
            if endpoint in tried:
                continue
            tried.append(endpoint)
            try:
                await self._import(endpoint, blob, sid)
                return endpoint
            except grpc.aio.AioRpcError as err:
                refusal = err
                self.on_refused(endpoint, err)
            if not candidates:
                candidates = await self._reroute(tried)
        assert refusal is not None
        raise refusal

    async def _import(self, endpoint: str, blob: bytes, sid: str) -> None:
        async with self.channels.lend(endpoint) as ch:
            worker = stub(worker_pb2_grpc.WorkerServiceStub, ch)
            try:
                await worker.ImportSession(worker_pb2.ImportSessionRequest(blob=blob), timeout=30)
            except grpc.aio.AioRpcError as err:
                if err.code() not in _REFUSED_CLEANLY:  # it may have landed: end that copy
                    await _cancel_quietly(worker, sid)
                raise

    async def _reroute(self, tried: list[str]) -> list[str]:
        try:
            routed = await route_client(self.daemon).route(self.route, timeout=ROUTE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return []
        fresh = [routed.decode_endpoint, routed.endpoint]
        return [e for e in fresh if e and e not in tried]


async def _cancel_quietly(worker: worker_pb2_grpc.WorkerServiceStub, sid: str) -> None:
    try:
        await worker.CancelSession(worker_pb2.CancelSessionRequest(session_id=sid), timeout=10)
    except grpc.aio.AioRpcError:
        return  # never imported there (NOT_FOUND), or unreachable: nothing more to do
