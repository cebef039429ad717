"""``fleetshift.v1.WorkerService`` in front of a vLLM server: the same interface, vLLM behind.

The daemon, the router, the gateway and the executor speak to a vLLM worker exactly as to a
reference worker. Each session is one streaming vLLM request whose tokens feed a ``Feed``
(the reference worker's), so clients attach and re-attach at any token index with the same
semantics. What vLLM cannot do here is refused by name: snapshots (no checkpoint/restore on
this host), a role its KV-transfer role excludes, KV carried inside a session blob.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from fleetshift.v1 import fleet_pb2, worker_pb2, worker_pb2_grpc
from fleetshift_agent.engine import TokenEvent
from fleetshift_agent.vllm_worker.client import VllmClient
from fleetshift_agent.vllm_worker.metrics import LatencyWindow, VllmStats, p50_p99_ms, parse_metrics
from fleetshift_agent.vllm_worker.sessions import Carried, SessionSpec
from fleetshift_agent.wire import ROLE_BY_NAME, ROLE_NAME_BY_PB
from fleetshift_agent.worker.feeds import Feed, Feeds, stream
from fleetshift_common.errors import (
    FailedPrecondition,
    FleetShiftError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from fleetshift_rpc.errors import rpc_errors, status_for
from fleetshift_rpc.server import ServiceBinding

log = logging.getLogger("fleetshift.vllm_worker")

ROLES = ROLE_BY_NAME
# What vLLM's KV-transfer role (fixed when the server starts) lets a worker be.
ROLES_BY_KV_ROLE = {
    "kv_both": ("prefill", "decode", "mixed"),
    "kv_producer": ("prefill",),
    "kv_consumer": ("decode",),
}
KV_NOTE = (
    "KV recomputed: a vLLM worker carries a session as its token history (vLLM's prefix "
    "cache reuses what it holds)"
)


@dataclass(frozen=True)
class VllmIdentity:
    """What GetInfo reports: the worker, its model and the key a move compares."""

    worker_id: str
    model_id: str
    compat_key: worker_pb2.WorkerCompatKey
    kv_role: str = ""  # the connector's, when one is configured


@dataclass
class VllmState:
    role: int
    draining: bool = False
    role_epoch: int = 0
    paused: bool = False
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    specs: dict[str, SessionSpec] = field(default_factory=dict)
    staged: dict[str, Carried] = field(default_factory=dict)


class VllmWorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        client: VllmClient,
        identity: VllmIdentity,
        role: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.identity = identity
        self.state = VllmState(role=ROLES[role])
        self.feeds = Feeds()
        self.clock = clock
        self.latency = LatencyWindow()
        self._last = VllmStats()

    # ---- clients ------------------------------------------------------------------------

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            feed, start = await self._open_stream(request)
        except FleetShiftError as err:
            await context.abort(status_for(err), err.message)
            return
        try:
            async for msg in stream(feed, start):
                yield msg
        except asyncio.CancelledError:
            if not feed.done:  # the client went away: so does its session
                self._end(feed.session_id, "cancelled")
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
            return self.feeds.get(request.resume_session_id, "resume_session_id"), (
                request.resume_from_token
            )
        if request.resume_from_token:
            raise InvalidArgument(
                "resume_from_token needs resume_session_id", field="resume_from_token"
            )
        if self.state.draining:
            raise Unavailable(
                "worker is draining (being retired): it takes no new session; route again",
                field="session_id",
            )
        spec = _spec(request)
        return await self._run(spec, []), 0

    async def _run(self, spec: SessionSpec, generated: list[int]) -> Feed:
        """Start the vLLM request that carries ``spec`` on from ``generated``; returns once
        vLLM accepted it (a refusal raises here, leaving nothing behind)."""
        feed = self.feeds.create(spec.session_id, generated)
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._pump(spec, feed, accepted), name=spec.session_id)
        try:
            await accepted
        except BaseException:
            task.cancel()
            self.feeds.discard(spec.session_id)
            raise
        self.state.tasks[spec.session_id] = task
        self.state.specs[spec.session_id] = spec
        task.add_done_callback(lambda _: self._forget(spec.session_id, task))
        return feed

    async def _pump(self, spec: SessionSpec, feed: Feed, accepted: asyncio.Future[None]) -> None:
        base = len(feed.tokens)
        index = base
        try:
            async for chunk in self.client.stream(spec.completion(feed.tokens[:base])):
                if not accepted.done():
                    accepted.set_result(None)
                for n, token in enumerate(chunk.tokens):
                    last = bool(chunk.finish_reason) and n == len(chunk.tokens) - 1
                    reason = chunk.finish_reason if last else ""
                    feed.push(TokenEvent(spec.session_id, index, token, last, reason))
                    index += 1
                if chunk.finish_reason and not chunk.tokens and not feed.done:
                    feed.close(f"vLLM ended the request ({chunk.finish_reason})")
            if not feed.done:
                feed.close("vLLM ended the request without a finish reason")
        except FleetShiftError as err:
            if not accepted.done():
                accepted.set_exception(err)
            else:
                log.warning("session %s failed: %s", spec.session_id, err.message)
                feed.close(f"engine failed: {err.message}")
        finally:
            if not accepted.done():
                accepted.set_exception(Unavailable("vLLM ended the request before it began"))

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self.state.tasks.get(session_id) is task:
            del self.state.tasks[session_id]

    def _end(self, session_id: str, why: str) -> list[int]:
        """Stop the session's vLLM request now (vLLM aborts it when the stream closes) and
        close its feed; the tokens it had. Synchronous on the loop: no token lands after."""
        task = self.state.tasks.pop(session_id, None)
        if task is not None:
            task.cancel()
        feed = self.feeds.get(session_id)
        feed.close(why)
        return list(feed.tokens)

    # ---- control ------------------------------------------------------------------------

    async def _run_state(self) -> worker_pb2.WorkerRunState:
        stats = await self._stats()
        return worker_pb2.WorkerRunState(paused=self.state.paused, steps=stats.steps)

    @rpc_errors
    async def Pause(
        self, request: worker_pb2.WorkerPauseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRunState:
        await self.client.pause()
        self.state.paused = True
        return await self._run_state()

    @rpc_errors
    async def Resume(
        self, request: worker_pb2.WorkerResumeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRunState:
        if request.steps:
            raise FailedPrecondition(
                "steps: vLLM cannot single-step; resume without steps", field="steps"
            )
        await self.client.resume()
        self.state.paused = False
        return await self._run_state()

    @rpc_errors
    async def Snapshot(
        self, request: worker_pb2.WorkerSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerSnapshotResponse:
        raise FailedPrecondition(
            "snapshot_id: a vLLM worker has no snapshot on this host (vLLM's checkpoint/restore "
            "needs CRIU and cuda-checkpoint); move it cold, its sessions as token history",
            field="snapshot_id",
        )

    @rpc_errors
    async def Restore(
        self, request: worker_pb2.WorkerRestoreRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRestoreResponse:
        raise FailedPrecondition(
            "path: a vLLM worker restores no snapshot; import its sessions (ImportSession)",
            field="path",
        )

    @rpc_errors
    async def ExportSession(
        self, request: worker_pb2.ExportSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ExportSessionResponse:
        if not request.session_id:
            raise InvalidArgument("session_id must not be empty", field="session_id")
        feed = self.feeds.get(request.session_id)
        spec = self.state.specs.get(request.session_id)
        if feed.done or spec is None:
            raise FailedPrecondition(
                f"session_id {request.session_id!r} has ended "
                f"({feed.finish_reason or feed.closed})",
                field="session_id",
            )
        generated = self._end(feed.session_id, "moved") if request.release else list(feed.tokens)
        return worker_pb2.ExportSessionResponse(
            blob=spec.to_blob(generated, delta=bool(request.from_token)),
            kv_included=False,
            tokens=len(spec.prompt) + len(generated),
            generated=len(generated),
            delta=bool(request.from_token),
        )

    @rpc_errors
    async def ImportSession(
        self, request: worker_pb2.ImportSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ImportSessionResponse:
        if not request.blob:
            raise InvalidArgument("blob must not be empty", field="blob")
        carried = Carried.from_blob(request.blob)
        sid = carried.spec.session_id
        if request.delta_for:
            if request.delta_for not in self.state.staged or request.delta_for != sid:
                raise FailedPrecondition(
                    f"delta_for: no staged session {request.delta_for!r} for this delta",
                    field="delta_for",
                )
            base = self.state.staged[sid].generated
            if carried.generated[: len(base)] != base:
                raise FailedPrecondition(
                    "from_token: the delta does not continue the staged session's tokens",
                    field="from_token",
                )
        elif carried.delta:
            raise InvalidArgument(
                "blob is a delta: apply it to a staged session (delta_for)", field="delta_for"
            )
        if request.staged:
            self.state.staged[sid] = carried
        else:
            self.state.staged.pop(sid, None)
            await self._run(carried.spec, carried.generated)
        return worker_pb2.ImportSessionResponse(
            session_id=sid,
            kv_restored=False,
            kv_note=KV_NOTE,
            generated=len(carried.generated),
            staged=request.staged,
            tokens=len(carried.spec.prompt) + len(carried.generated),
        )

    @rpc_errors
    async def CancelSession(
        self, request: worker_pb2.CancelSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelSessionResponse:
        staged = self.state.staged.pop(request.session_id, None)
        if staged is not None:
            return worker_pb2.CancelSessionResponse(generated=len(staged.generated))
        feed = self.feeds.get(request.session_id)
        if feed.done:
            raise NotFound(
                f"session_id {request.session_id!r} is not live here", field="session_id"
            )
        generated = self._end(feed.session_id, "cancelled")
        return worker_pb2.CancelSessionResponse(generated=len(generated))

    async def _stats(self) -> VllmStats:
        self._last = parse_metrics(await self.client.metrics())
        return self._last

    @rpc_errors
    async def GetCounters(
        self, request: worker_pb2.GetWorkerCountersRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.WorkerCounters:
        stats = await self._stats()
        ttft, tbt = self.latency.add(self.clock(), stats)
        used, total = stats.daemon_blocks()
        ttft_ms, tbt_ms = p50_p99_ms(ttft), p50_p99_ms(tbt)
        return fleet_pb2.WorkerCounters(
            worker_id=self.identity.worker_id,
            prefill_tokens=stats.prompt_tokens,
            decode_tokens=stats.generation_tokens,
            queue_depth=stats.waiting,
            kv_blocks_used=used,
            kv_blocks_total=total,
            live_sessions=stats.running + stats.waiting,
            ttft_p50_ms=ttft_ms[0],
            ttft_p99_ms=ttft_ms[1],
            tbt_p50_ms=tbt_ms[0],
            tbt_p99_ms=tbt_ms[1],
        )

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id=self.identity.worker_id,
            role=self.state.role,  # type: ignore[arg-type]
            model_id=self.identity.model_id,
            compat_key=self.identity.compat_key,
            kv_block_size=self._last.block_size,
            kv_blocks_total=self._last.kv_blocks,
            compiled=False,
            paused=self.state.paused,
            session_ids=self.feeds.live_ids(),
            staged_session_ids=sorted(self.state.staged),
            draining=self.state.draining,
            role_epoch=self.state.role_epoch,
        )

    @rpc_errors
    async def GetInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self.info()

    @rpc_errors
    async def SetRole(
        self, request: worker_pb2.SetWorkerRoleRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        name = ROLE_NAME_BY_PB.get(request.role)
        if name is None:
            raise InvalidArgument(f"role {request.role} is not a worker role", field="role")
        check_role(name, self.identity.kv_role)
        if request.role != self.state.role:
            self.state.role = request.role
            self.state.role_epoch += 1
        return self.info()

    @rpc_errors
    async def SetDraining(
        self, request: worker_pb2.SetWorkerDrainingRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        self.state.draining = request.draining
        return self.info()

    async def close(self) -> None:
        for task in list(self.state.tasks.values()):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self.state.tasks.values(), return_exceptions=True)
        self.feeds.close_all("worker stopped")


def check_role(role: str, kv_role: str) -> None:
    """A role this worker's vLLM can take: any without a connector; with one, what its
    KV-transfer role (fixed at vLLM's start) allows. Refused by name otherwise."""
    allowed = ROLES_BY_KV_ROLE.get(kv_role, ("prefill", "decode", "mixed")) if kv_role else None
    if allowed is not None and role not in allowed:
        raise FailedPrecondition(
            f"role {role}: this vLLM worker's KV-transfer role is {kv_role}, fixed when vLLM "
            f"started, which allows only {', '.join(allowed)}; start a new worker in that role",
            field="role",
        )


def _spec(request: worker_pb2.GenerateRequest) -> SessionSpec:
    if not request.prompt_tokens:
        raise InvalidArgument("prompt_tokens must not be empty", field="prompt_tokens")
    if request.max_new_tokens <= 0:
        raise InvalidArgument("max_new_tokens must be > 0", field="max_new_tokens")
    sampling = request.sampling
    if sampling.temperature < 0:
        raise InvalidArgument("sampling.temperature must be >= 0", field="sampling.temperature")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidArgument("sampling.top_p must be in (0, 1]", field="sampling.top_p")
    seed = sampling.seed if sampling.HasField("seed") else secrets.randbits(63)
    return SessionSpec(
        session_id=request.session_id or uuid.uuid4().hex,
        prompt=tuple(request.prompt_tokens),
        max_new_tokens=request.max_new_tokens,
        temperature=sampling.temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=tuple(request.stop_token_ids),
    )


def binding(servicer: VllmWorkerServicer) -> ServiceBinding:
    return ServiceBinding(
        worker_pb2_grpc.add_WorkerServiceServicer_to_server,
        servicer,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
    )
