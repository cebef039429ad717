"""A stream its worker ends with CANCELLED is followed to the session's new worker, like a
stream the network cut (UNAVAILABLE) or the worker ended as moved (ABORTED): the client
resumes at its next token, none lost or repeated. Before, follow_session raised CANCELLED to
the caller: tests/replicas/test_failover.py lost a stream that way once in six runs on
2026-12-05 (the leader killed at ``switched``; which worker-side path cancelled the stream
was not found). A worker stopping with streams open is covered too (UNAVAILABLE).

Two real gRPC servers speak the worker protocol from a script (the tokens are the session's
indices), a third answers LocateSession."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from fleetshift.v1 import operations_pb2 as opb
from fleetshift.v1 import operations_pb2_grpc as opb_grpc
from fleetshift.v1 import worker_pb2 as wpb
from fleetshift.v1 import worker_pb2_grpc as wpb_grpc
from fleetshift_rpc.sessions import follow_session

TOKENS = 12


class Worker(wpb_grpc.WorkerServiceServicer):
    """Streams the session's tokens from where it is asked; ``stall_after`` stops sending
    (as a paused source does) once that many tokens are out."""

    def __init__(self, stall_after: int = TOKENS, cancel: bool = False) -> None:
        self.stall_after = stall_after
        self.cancel = cancel  # end the stalled stream by cancelling its handler
        self.streaming = asyncio.Event()
        self.stop = asyncio.Event()

    async def Generate(
        self, request: wpb.GenerateRequest, context: Any
    ) -> AsyncIterator[wpb.GenerateResponse]:
        for i in range(request.resume_from_token, TOKENS):
            if i >= self.stall_after:
                self.streaming.set()
                await self.stop.wait()
                if self.cancel:  # the worker's side ends the stream as cancelled
                    await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
                await asyncio.Event().wait()  # until the server stops
            yield wpb.GenerateResponse(
                session_id="s1", token=1000 + i, index=i, finished=i == TOKENS - 1
            )


class Locator(opb_grpc.OperationsServicer):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def LocateSession(
        self, request: opb.LocateSessionRequest, context: Any
    ) -> opb.SessionLocation:
        return opb.SessionLocation(session_id=request.session_id, endpoint=self.endpoint)


async def serve(add: Any, servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def followed(source: Worker, stop_server: bool) -> list[int]:
    """The session's indices as follow_session delivers them, the source stalling after 5
    tokens and then ending the stream (its handler cancelled, or its server stopped)."""
    source_server, source_at = await serve(wpb_grpc.add_WorkerServiceServicer_to_server, source)
    target_server, target_at = await serve(wpb_grpc.add_WorkerServiceServicer_to_server, Worker())
    daemon_server, daemon_at = await serve(
        opb_grpc.add_OperationsServicer_to_server, Locator(target_at)
    )
    got: list[int] = []
    try:
        async with grpc.aio.insecure_channel(daemon_at) as daemon:
            request = wpb.GenerateRequest(session_id="s1", prompt_tokens=[1, 2, 3])
            follow = follow_session(daemon, source_at, request, relocate_timeout_s=10)

            async def collect() -> None:
                async for msg in follow:
                    got.append(msg.index)

            collecting = asyncio.create_task(collect())
            await asyncio.wait_for(source.streaming.wait(), 10)
            source.stop.set()
            if stop_server:
                await source_server.stop(grace=0.5)
            await asyncio.wait_for(collecting, 10)
    finally:
        for server in (source_server, target_server, daemon_server):
            await server.stop(grace=0)
    return got


async def test_a_stream_its_worker_cancels_is_followed_to_the_new_worker() -> None:
    assert await followed(Worker(stall_after=5, cancel=True), stop_server=False) == list(
        range(TOKENS)
    )


async def test_a_stream_open_when_its_worker_stops_is_followed_to_the_new_worker() -> None:
    assert await followed(Worker(stall_after=5), stop_server=True) == list(range(TOKENS))
