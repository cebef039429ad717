"""Route over one long-lived RouteStream: what the fleet's router calls for every request.

A unary Route call pays gRPC's per-call work (a new HTTP/2 stream, headers, the server's
interceptors, a task per call in grpc.aio) on both sides, and on the daemon that cost more than
routing itself (docs/benchmarks.md). ``RouteClient`` sends every Route request of a process
down one stream per channel (or a few, ``lanes``) and matches the answers by id, so many
requests share one call; the requests queued while a message is being written go together in
the next one (and are answered in one), so under load they share its cost too.

For the caller nothing changes: ``route`` returns the RouteResponse unary Route would have
returned, and a refused request raises ``grpc.aio.AioRpcError`` with the code and message
unary Route would have ended with (``RouteRefused``), so code written against the unary stub
(``err.code() == UNAVAILABLE``) keeps working.

Failures of the stream itself: a stream that breaks (its daemon replica died or restarted) is
reopened on the same channel (a channel listing every replica balances the new stream onto a
live one) and the requests that had no answer are sent again, within each request's own
timeout. A request that had been written to the broken stream goes again marked ``reroute``:
the daemon may have routed it before the break, and must not count it twice in the traffic
mix (the leader plans on every replica's arrivals). One the daemon never read is then not
counted at all, the lesser error: one lost arrival instead of one per break.

A daemon that predates RouteStream (UNIMPLEMENTED) is called with unary Route from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.bounds import MAX_ROUTE_BATCH

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# The stream ended for reasons that say nothing about the requests: send them again.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
RESEND_LIMIT = 5  # attempts per request, as the replica channel's retry policy for UNAVAILABLE
RESEND_BACKOFF_S = 0.05
# The daemon names itself (host and process) in a RouteStream's headers, so a client can tell
# two lanes that landed on the same replica; "" (an older daemon): lanes are kept as they land.
REPLICA_HEADER = "fleetshift-replica"


class RouteRefused(grpc.aio.AioRpcError):
    """One request refused on the stream, as unary Route would have refused it."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)
        self.field = field


@dataclass
class _Pending:
    request: pb.RouteRequest
    answer: asyncio.Future[pb.RouteResponse]
    attempts: int = 0
    written: bool = False  # handed to a stream: the daemon may have routed (and counted) it


@dataclass
class _Lane:
    """One RouteStream call: a task writing its queued requests, a task reading its answers.

    Written with ``call.write`` rather than a request iterator: when the daemon ends the call
    (UNIMPLEMENTED on an older daemon), grpc.aio's iterator consumer fails its next send and
    the call then reports INTERNAL instead of the daemon's status."""

    outbox: asyncio.Queue[pb.RouteStreamItem | None] = field(default_factory=asyncio.Queue)
    waiting: dict[int, _Pending] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    writer: asyncio.Task[None] | None = None
    call: grpc.aio.StreamStreamCall | None = None
    broken: bool = False
    opened: bool = False  # the daemon's headers came: the stream is bound to its replica
    peer: str = ""
    keep: Callable[[_Lane], bool] = lambda lane: True
    # A write failed: the connection went under it (a daemon stopped, its GOAWAY not yet read).
    # grpc.aio then ends the call INTERNAL ("Failed execute_batch"), not with the transport's
    # UNAVAILABLE, though the request never reached a daemon: its requests go again.
    write_failed: bool = False

    async def write(self) -> None:
        assert self.call is not None
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # Nothing is sent before the daemon has answered the call (a RouteStream server
            # sends its headers at once): a daemon without RouteStream answers UNIMPLEMENTED
            # at once too, and a request written meanwhile would turn that into INTERNAL.
            headers = await self.call.initial_metadata()
            if self.call.done():
                return
            self.peer = str(dict(headers or ()).get(REPLICA_HEADER, ""))
            if not self.keep(self):
                self.call.cancel()  # before anything is written: the reader sends it again
                return
            self.opened = True
            while True:
                # Everything queued goes in one message: requests that arrive while a write is
                # in flight share the next one, so the per-message cost is paid per batch.
                item = await self.outbox.get()
                batch = pb.RouteStreamRequest()
                while item is not None:
                    batch.requests.append(item)
                    if self.outbox.empty() or len(batch.requests) >= MAX_ROUTE_BATCH:
                        break
                    item = self.outbox.get_nowait()
                if batch.requests:
                    for sent in batch.requests:
                        pending = self.waiting.get(sent.id)
                        if pending is not None:
                            pending.written = True
                    try:
                        await self.call.write(batch)
                    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        self.write_failed = True
                        raise
                if item is None:
                    await self.call.done_writing()
                    return
        # the call ended: the reader reports how, and the waiting requests go again


class RouteClient:
    """Route calls multiplexed over ``lanes`` RouteStream calls on one channel."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        lanes: int = 1,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self._stub = pb_grpc.PlacementStub(channel)
        self._metadata = metadata
        self._lanes: list[_Lane | None] = [None] * lanes
        self._turn = itertools.cycle(range(lanes))
        self._ids = itertools.count(1)
        self._unary = False  # the daemon has no RouteStream: unary Route from now on
        self._closed = False
        self._reopened = 0  # lanes reopened because they shared a replica (bounded)

    async def route(
        self, request: pb.RouteRequest, timeout: float | None = 5.0
    ) -> pb.RouteResponse:
        """What unary ``Route(request, timeout=timeout)`` answers, sent on the stream."""
        if self._unary:
            return await self._unary_route(request, timeout)
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self._send(pending)
        try:
            # A timeout (or the caller's cancellation) cancels the future: a late answer,
            # or a resend, then finds it done and drops it. asyncio.timeout, not wait_for:
            # on Python 3.11 wait_for returns an answer that lands as the caller is
            # cancelled, swallowing the cancellation (heartbeat_stream's test shows it).
            async with asyncio.timeout(timeout):
                return await pending.answer
        except TimeoutError:
            raise RouteRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except _FallBack:
            return await self._unary_route(request, timeout)

    async def _unary_route(
        self, request: pb.RouteRequest, timeout: float | None
    ) -> pb.RouteResponse:
        answer: pb.RouteResponse = await self._stub.Route(
            request, timeout=timeout, metadata=self._metadata
        )
        return answer

    def _send(self, pending: _Pending) -> None:
        if self._closed:
            pending.answer.set_exception(RouteRefused(grpc.StatusCode.CANCELLED, "closed"))
            return
        if self._unary:
            pending.answer.set_exception(_FallBack())
            return
        if pending.written and not pending.request.reroute:
            # Sent again after its stream broke: the daemon may have routed it already, so it
            # goes as a reroute (not counted a second time in the traffic mix, whichever
            # replica answers it); the caller's message is left as it was.
            again = pb.RouteRequest()
            again.CopyFrom(pending.request)
            again.reroute = True
            pending.request = again
        lane = self._lane()
        request_id = next(self._ids)
        pending.attempts += 1
        lane.waiting[request_id] = pending
        lane.outbox.put_nowait(pb.RouteStreamItem(id=request_id, route=pending.request))

    def _lane(self) -> _Lane:
        slot = next(self._turn)
        lane = self._lanes[slot]
        if lane is None or lane.broken:
            # A stream is balanced once, when it opens, onto a replica whose connection is
            # ready then: lanes opened together on a fresh channel all land on the first
            # replica to connect (4 of 5 fresh two-replica channels did). So one lane opens at
            # a time; until its replica answers, requests share it, and the next lane opens
            # once the channel's other connections have had that round trip to come up.
            for other in self._lanes:
                if other is not None and not other.broken and not other.opened:
                    return other
            lane = self._lanes[slot] = _Lane(keep=self._keep)
            lane.call = self._stub.RouteStream(metadata=self._metadata)
            loop = asyncio.get_running_loop()
            lane.writer = loop.create_task(lane.write())
            lane.reader = loop.create_task(self._read(lane))
        return lane

    def _keep(self, lane: _Lane) -> bool:
        """False when ``lane``'s new stream landed on the replica of another open lane: it is
        reopened, and the channel's round robin picks the next replica. Bounded (twice the
        lanes over the client's life): with a replica down, lanes must share the others."""
        if self._reopened >= 2 * len(self._lanes) or not lane.peer:
            return True
        for other in self._lanes:
            if (
                other is not None
                and other is not lane
                and other.opened
                and not other.broken
                and other.peer == lane.peer
            ):
                self._reopened += 1
                return False
        return True

    async def _read(self, lane: _Lane) -> None:
        assert lane.call is not None
        try:
            async for msg in lane.call:
                for answer in msg.answers:
                    pending = lane.waiting.pop(answer.id, None)
                    if pending is None or pending.answer.done():
                        continue  # its caller gave up (timeout)
                    if answer.HasField("error"):
                        error = answer.error
                        code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
                        pending.answer.set_exception(RouteRefused(code, error.message, error.field))
                    else:
                        pending.answer.set_result(answer.route)
            ended: grpc.aio.AioRpcError = RouteRefused(
                grpc.StatusCode.UNAVAILABLE, "the daemon ended the RouteStream"
            )
        except grpc.aio.AioRpcError as err:
            ended = err
        except asyncio.CancelledError:
            ended = RouteRefused(grpc.StatusCode.CANCELLED, "closed")
        lane.broken = True
        lane.outbox.put_nowait(None)
        self._orphaned(lane, ended)

    def _orphaned(self, lane: _Lane, ended: grpc.aio.AioRpcError) -> None:
        """The requests a broken stream left without an answer: sent again, or failed."""
        waiting, lane.waiting = lane.waiting, {}
        if ended.code() is grpc.StatusCode.UNIMPLEMENTED:
            self._unary = True
        for pending in waiting.values():
            if pending.answer.done():
                continue
            if self._unary:
                pending.answer.set_exception(_FallBack())
            elif self._closed or not _retryable(lane, ended) or pending.attempts >= RESEND_LIMIT:
                pending.answer.set_exception(ended)
            else:
                asyncio.get_running_loop().call_later(RESEND_BACKOFF_S, self._resend, pending)

    def _resend(self, pending: _Pending) -> None:
        if pending.answer.done():
            return
        try:
            self._send(pending)
        except Exception as err:  # the channel closed meanwhile: the request cannot go
            pending.answer.set_exception(
                RouteRefused(grpc.StatusCode.UNAVAILABLE, f"RouteStream cannot reopen: {err}")
            )

    async def close(self) -> None:
        """End every stream; requests still waiting fail with CANCELLED."""
        self._closed = True
        for lane in self._lanes:
            if lane is None:
                continue
            lane.outbox.put_nowait(None)
            if lane.call is not None:
                lane.call.cancel()
            for task in (lane.reader, lane.writer):
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        self._lanes = [None] * len(self._lanes)


def _retryable(lane: _Lane, ended: grpc.aio.AioRpcError) -> bool:
    """Whether a broken stream's requests go again: the daemon went away (UNAVAILABLE), the
    stream was cancelled under them, or grpc.aio turned a write on a dead connection into
    INTERNAL (``_Lane.write_failed``)."""
    code = ended.code()
    return code in _RETRYABLE or (lane.write_failed and code is grpc.StatusCode.INTERNAL)


class _FallBack(Exception):
    """Internal: this request goes by unary Route (the daemon has no RouteStream)."""


_clients: weakref.WeakKeyDictionary[grpc.aio.Channel, RouteClient] = weakref.WeakKeyDictionary()


def route_client(channel: grpc.aio.Channel) -> RouteClient:
    """The one RouteClient of ``channel``, made on first use and kept as long as the channel:
    every caller on a channel shares its stream, which is the point."""
    client = _clients.get(channel)
    if client is None:
        client = _clients[channel] = RouteClient(channel)
    return client
