"""The session semantics every engine's worker serves, written once.

A client opens a session or re-attaches to one at a token index; a draining worker takes no
new session; a role change bumps the epoch the daemon orders role answers by; an exported
session must still be live. The reference worker and the vLLM worker differ only in how a
session runs (an engine step loop, or one vLLM request), so both subclass
``SessionServicer`` and supply the engine-specific parts: how a new session starts, what a
client that went away ends, the counters, and the ``WorkerInfo`` fields only they know.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from fleetshift.v1 import fleet_pb2, worker_pb2, worker_pb2_grpc
from fleetshift_agent.wire import ROLE_NAME_BY_PB
from fleetshift_agent.worker.feeds import Feed, Feeds, stream
from fleetshift_common.errors import (
    FailedPrecondition,
    FleetShiftError,
    InvalidArgument,
    Unavailable,
)
from fleetshift_rpc.errors import rpc_errors, status_for
from fleetshift_rpc.server import ServiceBinding


class SessionFlags(Protocol):
    """The worker-wide state the session core reads and writes (each worker's own state
    object carries these alongside what only its engine needs)."""

    role: int
    draining: bool
    role_epoch: int


@dataclass(frozen=True)
class Counters:
    """One heartbeat's counters, whatever engine produced them (latencies as p50, p99 ms)."""

    prefill_tokens: int
    decode_tokens: int
    queue_depth: int
    kv_blocks_used: int
    kv_blocks_total: int
    live_sessions: int
    ttft_ms: tuple[float, float]
    tbt_ms: tuple[float, float]


S = TypeVar("S", bound=SessionFlags)


class SessionServicer(worker_pb2_grpc.WorkerServiceServicer, Generic[S]):
    """Generate (open or re-attach), SetRole, SetDraining, GetInfo and GetCounters for any
    engine; the subclass sets ``feeds``, ``state`` and implements the abstract hooks."""

    feeds: Feeds
    state: S

    # ---- what each engine supplies -------------------------------------------------------

    @property
    @abstractmethod
    def worker_id(self) -> str: ...

    @abstractmethod
    async def _start_session(self, request: worker_pb2.GenerateRequest) -> Feed:
        """Start a new session for ``request`` (already checked: not a re-attach, worker not
        draining); returns its feed once the engine took it, leaving nothing on refusal."""

    @abstractmethod
    def _client_gone(self, feed: Feed) -> None:
        """The client of a live session went away: end the session."""

    @abstractmethod
    async def _counters(self) -> Counters: ...

    @abstractmethod
    def _info_fields(self) -> dict[str, Any]:
        """``WorkerInfo`` fields only the engine knows (model, key, KV geometry, paused...)."""

    def _check_role(self, role: str) -> None:
        """Refuse, by name, a role this engine cannot take in place (default: any is fine)."""

    # ---- clients ------------------------------------------------------------------------

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            feed, start = await self._open_stream(request)
        except FleetShiftError as err:
            await context.abort(status_for(err), err.message)
            return
        try:
            async for msg in stream(feed, start, request.tokens_per_message):
                yield msg
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: so does its session. grpc cancels the task that writes
            # our messages, so a cancel that lands while a message is being written (a busy
            # stream: the usual case) never reaches this generator as CancelledError; grpc
            # leaves it suspended at its ``yield`` and it is closed later (GeneratorExit).
            if not feed.done:
                self._client_gone(feed)
            raise
        if feed.closed:
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"session {feed.session_id!r} left this worker ({feed.closed}) after "
                f"{len(feed.tokens)} tokens",
            )

    async def _open_stream(self, request: worker_pb2.GenerateRequest) -> tuple[Feed, int]:
        if request.resume_session_id:
            for name in ("prompt_tokens", "stop_token_ids"):
                if len(getattr(request, name)):
                    raise InvalidArgument(
                        f"{name} must be empty with resume_session_id", field=name
                    )
            if request.hold_after_tokens:
                raise InvalidArgument(
                    "hold_after_tokens must be 0 with resume_session_id",
                    field="hold_after_tokens",
                )
            feed = self.feeds.get(request.resume_session_id, "resume_session_id")
            return feed, request.resume_from_token
        if request.resume_from_token:
            raise InvalidArgument(
                "resume_from_token needs resume_session_id", field="resume_from_token"
            )
        if self.state.draining:
            raise Unavailable(
                "worker is draining (being retired): it takes no new session; route again",
                field="session_id",
            )
        return await self._start_session(request), 0

    def _live_feed(self, session_id: str) -> Feed:
        """The feed of a session that may be exported: named, present, not ended."""
        if not session_id:
            raise InvalidArgument("session_id must not be empty", field="session_id")
        feed = self.feeds.get(session_id)
        if feed.done:
            raise FailedPrecondition(
                f"session_id {session_id!r} has ended ({feed.finish_reason or feed.closed})",
                field="session_id",
            )
        return feed

    # ---- control ------------------------------------------------------------------------

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=self.state.role,  # type: ignore[arg-type]
            session_ids=self.feeds.live_ids(),
            unread_session_ids=self.feeds.unread_ids(),
            finished_sessions=[
                fleet_pb2.FinishedSession(
                    session_id=f.session_id,
                    prompt_tokens=f.prompt_tokens,
                    output_tokens=f.output_tokens,
                    finish_reason=f.finish_reason,
                )
                for f in self.feeds.finished()
            ],
            draining=self.state.draining,
            role_epoch=self.state.role_epoch,
            **self._info_fields(),
        )

    @rpc_errors
    async def GetInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerInfo:
        return self.info()

    @rpc_errors
    async def SetRole(
        self, request: worker_pb2.SetWorkerRoleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerInfo:
        name = ROLE_NAME_BY_PB.get(request.role)
        if name is None:
            raise InvalidArgument(f"role {request.role} is not a worker role", field="role")
        self._check_role(name)
        if request.role != self.state.role:
            self.state.role = request.role
            self.state.role_epoch += 1
        return self.info()

    @rpc_errors
    async def SetDraining(
        self,
        request: worker_pb2.SetWorkerDrainingRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> worker_pb2.WorkerInfo:
        self.state.draining = request.draining
        return self.info()

    @rpc_errors
    async def GetCounters(
        self,
        request: worker_pb2.GetWorkerCountersRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> fleet_pb2.WorkerCounters:
        c = await self._counters()
        return fleet_pb2.WorkerCounters(
            worker_id=self.worker_id,
            prefill_tokens=c.prefill_tokens,
            decode_tokens=c.decode_tokens,
            queue_depth=c.queue_depth,
            kv_blocks_used=c.kv_blocks_used,
            kv_blocks_total=c.kv_blocks_total,
            live_sessions=c.live_sessions,
            ttft_p50_ms=c.ttft_ms[0],
            ttft_p99_ms=c.ttft_ms[1],
            tbt_p50_ms=c.tbt_ms[0],
            tbt_p99_ms=c.tbt_ms[1],
        )


def binding(servicer: SessionServicer[Any]) -> ServiceBinding:
    return ServiceBinding(
        worker_pb2_grpc.add_WorkerServiceServicer_to_server,
        servicer,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
    )
