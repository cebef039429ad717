"""A client stream that follows its session across moves.

A move ends the source worker's stream with ABORTED ("moved") once the target owns the
session; the client asks the daemon where the session lives now and re-attaches there at the
next token index, so the caller sees one uninterrupted, duplicate-free token stream. A worker
being retired refuses a *new* session with UNAVAILABLE: that session never existed, so there
is nothing to locate, and ``routed_session`` asks the router again instead. This is what the
fleet's router (or any client library) does; tests use it to prove no token is lost.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import grpc

from fleetshift.v1 import (
    operations_pb2,
    operations_pb2_grpc,
    placement_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from fleetshift_rpc.route_stream import route_client

# Opens (or lends) a channel to a worker endpoint; the default opens a fresh one per stream.
ChannelFor = Callable[[str], AbstractAsyncContextManager[grpc.aio.Channel]]

# A stream ended with one of these is followed to where the session lives now. CANCELLED
# here is the worker's side ending the stream (a call the caller cancels raises
# asyncio.CancelledError instead): no worker ends a session that way on purpose (a cancelled
# session ends ABORTED), so it is a stream cut short, e.g. by a worker stopping; if the
# session is really gone, LocateSession says so and the caller gets SessionLost.
RELOCATABLE = (
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.CANCELLED,
)


class SessionLost(Exception):
    pass


_Stub = TypeVar("_Stub")
_stubs: weakref.WeakKeyDictionary[grpc.aio.Channel, dict[Any, Any]] = weakref.WeakKeyDictionary()


def stub(cls: Callable[[grpc.aio.Channel], _Stub], channel: grpc.aio.Channel) -> _Stub:
    """One stub per (class, channel), kept as long as the channel lives: building a stub
    builds a callable per method (a dozen for the worker service), which a caller streaming
    every request through long-lived channels (the HTTP gateway) would pay per request."""
    per_channel = _stubs.setdefault(channel, {})
    made = per_channel.get(cls)
    if made is None:
        made = per_channel[cls] = cls(channel)
    result: _Stub = made
    return result


async def follow_session(
    daemon: grpc.aio.Channel,
    endpoint: str,
    request: worker_pb2.GenerateRequest,
    *,
    relocate_timeout_s: float = 120.0,
    max_message_bytes: int = 64 << 20,
    channel_for: ChannelFor | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    tokens_per_message: int = 0,
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """Yield the session's tokens in order, re-attaching after each move, until it finishes.

    ``channel_for`` lets a long-lived caller (the HTTP gateway) reuse one channel per worker
    instead of connecting afresh for every stream. ``credentials`` are what a fresh channel
    dials workers with: on a fleet with TLS, a certificate the workers' nodes list in
    ``worker_session_callers`` (a router's, by default). ``tokens_per_message`` (> 1) asks
    every worker the session streams from to put the tokens it already has in one message
    (the request's own value otherwise); the caller still gets one message per token."""
    locator = stub(operations_pb2_grpc.OperationsStub, daemon)
    per_message = tokens_per_message or request.tokens_per_message
    if per_message != request.tokens_per_message:
        request = _with_tokens_per_message(request, per_message)
    session_id, received, first = request.session_id, 0, True
    loop = asyncio.get_running_loop()
    lost_since: float | None = None  # a session that stays unreachable this long is lost
    options = [("grpc.max_receive_message_length", max_message_bytes)]
    connect = channel_for or (lambda ep: _dial(ep, options, credentials))
    while True:
        call_request = (
            request
            if first
            else worker_pb2.GenerateRequest(
                resume_session_id=session_id,
                resume_from_token=received,
                tokens_per_message=per_message,
            )
        )
        try:
            async with connect(endpoint) as ch:
                call = stub(worker_pb2_grpc.WorkerServiceStub, ch).Generate(call_request)
                async for msg in each_token(call):
                    first = False
                    session_id = msg.session_id
                    lost_since = None
                    if msg.index < received:
                        continue  # replayed by the new worker: already delivered
                    received = msg.index + 1
                    yield msg
                    if msg.finished:
                        return
        except grpc.aio.AioRpcError as err:
            opening = first and not request.resume_session_id  # no token of a new session yet
            if (
                err.code() not in RELOCATABLE
                or not session_id
                or (first and not request.session_id)
                or (opening and err.code() == grpc.StatusCode.UNAVAILABLE)  # refused: route again
            ):
                raise
            first = False
        lost_since = lost_since if lost_since is not None else loop.time()
        if loop.time() - lost_since > relocate_timeout_s:
            raise SessionLost(f"session {session_id!r} unreachable for {relocate_timeout_s}s")
        endpoint = await _locate(locator, session_id, endpoint, relocate_timeout_s)


def one_per_token(msg: worker_pb2.GenerateResponse) -> Sequence[worker_pb2.GenerateResponse]:
    """A message of several tokens (``more_tokens``) as one message per token, in order:
    each with its own index, the last carrying the message's ``finished`` and reason."""
    if not msg.more_tokens:
        return (msg,)
    tokens = [msg.token, *msg.more_tokens]
    end = len(tokens) - 1
    return [
        worker_pb2.GenerateResponse(
            session_id=msg.session_id,
            token=token,
            index=msg.index + i,
            finished=msg.finished and i == end,
            finish_reason=msg.finish_reason if i == end else "",
        )
        for i, token in enumerate(tokens)
    ]


async def each_token(
    call: AsyncIterator[worker_pb2.GenerateResponse],
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """A worker's Generate stream as one message per token (it may pack several in one)."""
    async for message in call:
        for msg in one_per_token(message):
            yield msg


def _with_tokens_per_message(
    request: worker_pb2.GenerateRequest, per_message: int
) -> worker_pb2.GenerateRequest:
    """A copy of ``request`` (the caller's stays as it was) asking for ``per_message``."""
    copy = worker_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.tokens_per_message = per_message
    return copy


async def routed_session(
    daemon: grpc.aio.Channel,
    route: placement_pb2.RouteRequest,
    request: worker_pb2.GenerateRequest,
    *,
    endpoint: str = "",
    reroute_timeout_s: float = 30.0,
    relocate_timeout_s: float = 120.0,
    max_message_bytes: int = 64 << 20,
    channel_for: ChannelFor | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    tokens_per_message: int = 0,
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """A new session on the worker the daemon routes it to, followed across moves.

    A worker that refuses the session before its first token (UNAVAILABLE: it drains for
    retirement, or cannot be reached) is routed around: Route is asked again, and the router,
    which counts a draining worker out, answers with another. ``endpoint`` is a route the
    caller already holds (routers cache them); it is tried first. Every Route call after the
    first is marked ``reroute``, so the daemon's traffic mix counts the request once (set it
    on ``route`` too when ``endpoint`` came from a Route call for this same request).
    """
    placement = route_client(daemon)  # the channel's one RouteStream, shared by every caller
    loop = asyncio.get_running_loop()
    deadline = loop.time() + reroute_timeout_s
    again = placement_pb2.RouteRequest()
    again.CopyFrom(route)
    again.reroute = True
    while True:
        if not endpoint:
            endpoint = (await placement.route(route, timeout=5)).endpoint
            route = again  # counted once: every later Route call is a re-route
        started = False
        try:
            async for msg in follow_session(
                daemon,
                endpoint,
                request,
                relocate_timeout_s=relocate_timeout_s,
                max_message_bytes=max_message_bytes,
                channel_for=channel_for,
                credentials=credentials,
                tokens_per_message=tokens_per_message,
            ):
                started = True
                yield msg
            return
        except grpc.aio.AioRpcError as err:
            if started or err.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > deadline:
                raise
        endpoint = ""
        await asyncio.sleep(0.05)


def _dial(
    endpoint: str, options: list[tuple[str, int]], credentials: grpc.ChannelCredentials | None
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, credentials, options=options)


async def _locate(
    locator: operations_pb2_grpc.OperationsStub, session_id: str, old: str, timeout_s: float
) -> str:
    """Where the session lives now. The same endpoint again is a valid answer after a short
    wait: a target can refuse a re-attach for a moment (the session not yet imported there),
    and a registry can lag a switch by a heartbeat."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            where = await locator.LocateSession(
                operations_pb2.LocateSessionRequest(session_id=session_id), timeout=5
            )
            if where.endpoint and where.endpoint != old:
                return str(where.endpoint)
            if where.endpoint:
                await asyncio.sleep(0.05)
                return str(where.endpoint)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise
        if loop.time() > deadline:
            raise SessionLost(f"session {session_id!r} did not reappear within {timeout_s}s")
        await asyncio.sleep(0.05)
