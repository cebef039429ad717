"""A node's heartbeats over one long-lived HeartbeatStream call per daemon replica.

Every node heartbeats every replica each interval, so a fleet of N nodes and R replicas sends
N x R calls per interval, and a unary call's fixed work (a new HTTP/2 stream, headers, the
server's interceptors, a task per call in grpc.aio) costs the daemon more than the heartbeat
itself (docs/benchmarks.md: under the load bench, gRPC's own machinery was two thirds of a
replica's CPU). ``HeartbeatSender`` sends each heartbeat as one message on a call it keeps
open, and reads its answer before the next is sent: one heartbeat in flight per replica, as
before, so the agent's report ordering (no report built before a worker change is answered
after it) is unchanged.

For the caller nothing changes: ``send`` returns what unary Heartbeat returns and raises
``grpc.aio.AioRpcError`` with the status unary Heartbeat would end with (the daemon ends the
call with that status, and the next heartbeat opens a new one). A heartbeat not answered
within its timeout raises DEADLINE_EXCEEDED and cancels the call, as a unary deadline would.
A daemon without HeartbeatStream (UNIMPLEMENTED: an older daemon in a rolling upgrade) is sent
unary Heartbeat, and the stream is tried again every ``STREAM_RETRY_S``: the daemon behind the
address may be upgraded in place, and a daemon that knows the node never asks it to register
again, so nothing else would tell the agent.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc

STREAM_RETRY_S = 60.0  # after an UNIMPLEMENTED, unary heartbeats this long, then try again


class HeartbeatRefused(grpc.aio.AioRpcError):
    """A heartbeat the stream did not answer, with the status unary Heartbeat would give."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


class _FallBack(Exception):
    """The daemon has no HeartbeatStream."""


class HeartbeatSender:
    """Heartbeats to one daemon (one channel), over a HeartbeatStream kept open."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = pb_grpc.AgentRegistryStub(channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._unary_until = 0.0  # time.monotonic() before which the daemon gets unary calls
        self.calls_opened = 0  # streams opened (observability, tests)

    async def send(self, request: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatResponse:
        """What unary ``Heartbeat(request, timeout=timeout)`` answers, sent on the stream."""
        if not self.unary:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the inner
                # result when it completes as the caller is cancelled, swallowing the
                # cancellation, and an agent stopping then heartbeated on for ever (CI hung).
                async with asyncio.timeout(timeout):
                    return await self._exchange(request)
            except TimeoutError:
                self.close()  # its answer, if it comes, must not answer the next heartbeat
                raise HeartbeatRefused(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
                ) from None
            except _FallBack:
                self._unary_until = time.monotonic() + STREAM_RETRY_S
        reply: pb.HeartbeatResponse = await self._stub.Heartbeat(request, timeout=timeout)
        return reply

    @property
    def unary(self) -> bool:
        """True while the daemon is sent unary Heartbeat (it answered UNIMPLEMENTED)."""
        return time.monotonic() < self._unary_until

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _exchange(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        call = self._call or await self._open()
        try:
            await call.write(request)
            reply = await call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._call = None
            raise await _ended(call) from None
        if reply is grpc.aio.EOF:
            self._call = None
            raise await _ended(call)
        assert isinstance(reply, pb.HeartbeatResponse)
        return reply

    async def _open(self) -> grpc.aio.StreamStreamCall:
        """A new call, once the daemon has answered it: the daemon sends its headers at once,
        and one without HeartbeatStream ends the call at once (UNIMPLEMENTED); a heartbeat
        written before that answer would turn it into INTERNAL."""
        call: grpc.aio.StreamStreamCall = self._stub.HeartbeatStream()
        self.calls_opened += 1
        try:
            await call.initial_metadata()
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:  # the heartbeat's timeout, while the daemon is silent
            call.cancel()
            raise
        if call.done():
            if await call.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _FallBack
            raise await _ended(call)
        self._call = call
        return call


async def _ended(call: grpc.aio.StreamStreamCall) -> HeartbeatRefused:
    """How the daemon ended ``call``, as the error unary Heartbeat would have raised."""
    code = await call.code()
    details = await call.details()
    if code == grpc.StatusCode.OK:  # ended without answering: treat as a daemon going away
        return HeartbeatRefused(
            grpc.StatusCode.UNAVAILABLE, "the daemon ended the heartbeat stream without an answer"
        )
    return HeartbeatRefused(code, details or "")
