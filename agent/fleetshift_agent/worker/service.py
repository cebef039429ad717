"""``fleetshift.v1.WorkerService``: token streams for clients, control for the node agent.

Handlers translate messages and call the engine through the runner, so every control call
sees the engine at a step boundary; typed errors become gRPC statuses naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine import Engine, SamplingParams, Session, SessionExport
from fleetshift_agent.engine.delta import DELTA_KEY
from fleetshift_agent.engine.state import RestoreReport, capture_state
from fleetshift_agent.snapshot import open_snapshot
from fleetshift_agent.wire import ROLE_BY_NAME
from fleetshift_agent.worker.feeds import Feed, Feeds
from fleetshift_agent.worker.runner import EngineRunner
from fleetshift_agent.worker.session_core import Counters, SessionServicer
from fleetshift_agent.worker.snapshots import (
    engine_key,
    import_snapshot_sessions,
    write_engine_snapshot,
)
from fleetshift_common.compat import CompatVerdict
from fleetshift_common.errors import (
    FleetShiftError,
    InvalidArgument,
)
from fleetshift_rpc.errors import rpc_errors

log = logging.getLogger("fleetshift.worker")

ROLES = ROLE_BY_NAME


@dataclass
class WorkerState:
    worker_id: str
    role: int
    restored_from: str = ""
    draining: bool = False  # refuse new sessions: the daemon is retiring this worker
    role_epoch: int = 0  # role changes since start: orders the role answers the daemon sees
    background: set[asyncio.Task[None]] = field(default_factory=set)


@dataclass(frozen=True)
class _Held:
    """An imported session as it stood at the step boundary of its import."""

    session_id: str
    tokens: int
    prompt_len: int
    kv_restored: bool

    @classmethod
    def of(cls, s: Session) -> _Held:
        return cls(s.session_id, len(s.tokens), s.prompt_len, bool(s.cached))


def _feed_of(s: Session) -> tuple[str, list[int], int]:
    """What a feed for an engine session that arrived here starts from: its id, the tokens
    it generated so far (also before a move) and its prompt's length."""
    return s.session_id, list(s.generated), s.prompt_len


def _sampling(msg: worker_pb2.WorkerSampling) -> SamplingParams:
    seed = msg.seed if msg.HasField("seed") else secrets.randbits(63)
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    try:
        return SamplingParams(temperature=msg.temperature, top_p=top_p, seed=seed)
    except InvalidArgument as err:
        raise InvalidArgument(f"sampling.{err.message}", field=f"sampling.{err.field}") from None


def _percentiles(samples: tuple[float, ...]) -> tuple[float, float]:
    if not samples:
        return 0.0, 0.0
    p50, p99 = np.percentile(np.asarray(samples), [50, 99])
    return float(p50), float(p99)


class WorkerServicer(SessionServicer[WorkerState]):
    def __init__(
        self,
        runner: EngineRunner,
        feeds: Feeds,
        state: WorkerState,
        loop: asyncio.AbstractEventLoop,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = loop
        self.runner = runner
        self.engine: Engine = runner.engine
        self.feeds = feeds
        self.state = state
        self.clock = clock
        self._staged: set[str] = set()  # touched on the event loop only

    # ---- clients ------------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    async def _start_session(self, request: worker_pb2.GenerateRequest) -> Feed:
        params = _sampling(request.sampling)
        sid = request.session_id or uuid.uuid4().hex
        feed = self.feeds.create(sid, prompt_tokens=len(request.prompt_tokens))
        prompt = list(request.prompt_tokens)
        stops = list(request.stop_token_ids)
        try:
            await self.runner.call(
                lambda: self.engine.add_session(sid, prompt, request.max_new_tokens, params, stops)
            )
        except BaseException:
            self.feeds.discard(sid)
            raise
        return feed

    def _client_gone(self, feed: Feed) -> None:
        self._in_background(self._cancel_quietly(feed.session_id))

    async def _cancel_quietly(self, session_id: str) -> None:
        try:
            await self.runner.call(lambda: self.engine.cancel(session_id))
        except FleetShiftError:
            return  # finished or moved meanwhile
        self.feeds.get(session_id).close("cancelled")

    def _in_background(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self.state.background.add(task)
        task.add_done_callback(self.state.background.discard)

    # ---- control ------------------------------------------------------------------------

    def _run_state(self) -> worker_pb2.WorkerRunState:
        return worker_pb2.WorkerRunState(paused=self.runner.paused, steps=self.engine.steps)

    @rpc_errors
    async def Pause(
        self, request: worker_pb2.WorkerPauseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRunState:
        await self.runner.call(lambda: self.runner.set_paused(True))
        return self._run_state()

    @rpc_errors
    async def Resume(
        self, request: worker_pb2.WorkerResumeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRunState:
        await self.runner.call(lambda: self.runner.set_paused(False, steps=request.steps))
        return self._run_state()

    @rpc_errors
    async def Snapshot(
        self, request: worker_pb2.WorkerSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerSnapshotResponse:
        if not request.dir:
            raise InvalidArgument("dir must name a directory", field="dir")
        if not request.snapshot_id:
            raise InvalidArgument("snapshot_id must not be empty", field="snapshot_id")
        root = Path(request.dir)
        if not root.is_dir():
            raise InvalidArgument(f"dir {request.dir!r} is not a directory", field="dir")
        started = self.clock()
        # The capture copies KV at a step boundary; writing happens while the engine runs on.
        state, key = await self.runner.call(
            lambda: (capture_state(self.engine), engine_key(self.engine))
        )
        paused_ms = (self.clock() - started) * 1000.0
        info = await asyncio.to_thread(write_engine_snapshot, state, key, root, request.snapshot_id)
        return worker_pb2.WorkerSnapshotResponse(
            path=str(info.path),
            snapshot_id=info.snapshot_id,
            session_ids=[s["session_id"] for s in state.json_parts["sessions"]],
            size_bytes=info.size_bytes,
            pause_ms=paused_ms,
            total_ms=(self.clock() - started) * 1000.0,
            compiled_artifacts=bool(state.artifacts),
        )

    @rpc_errors
    async def Restore(
        self, request: worker_pb2.WorkerRestoreRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRestoreResponse:
        if not request.path:
            raise InvalidArgument("path must name a snapshot directory", field="path")
        snap = await asyncio.to_thread(open_snapshot, Path(request.path))

        def restore() -> tuple[RestoreReport, CompatVerdict]:
            report, verdict = import_snapshot_sessions(self.engine, snap)
            seen = [_feed_of(self.engine.get(sid)) for sid in report.sessions]
            # Posted under the step lock, so the feeds exist before any token of theirs.
            self.loop.call_soon_threadsafe(self._create_feeds, seen)
            return report, verdict

        report, verdict = await self.runner.call(restore)
        return worker_pb2.WorkerRestoreResponse(
            session_ids=list(report.sessions),
            kv_restored=list(report.kv_restored),
            compat=verdict.describe(),
        )

    def _create_feeds(self, sessions: list[tuple[str, list[int], int]]) -> None:
        for sid, generated, prompt_len in sessions:
            self.feeds.create(sid, generated, prompt_len)

    @rpc_errors
    async def ExportSession(
        self, request: worker_pb2.ExportSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ExportSessionResponse:
        self._live_feed(request.session_id)

        def export() -> tuple[SessionExport, int, int]:
            exp = self.engine.export_session(
                request.session_id, with_kv=request.with_kv, from_token=request.from_token
            )
            s = self.engine.get(request.session_id)
            if request.release:
                self.engine.cancel(request.session_id)
            return exp, len(s.tokens), s.prompt_len

        exp, tokens, prompt_len = await self.runner.call(export)
        if request.release:
            self.feeds.get(request.session_id).close("moved")
        blob = await asyncio.to_thread(exp.to_bytes)
        return worker_pb2.ExportSessionResponse(
            blob=blob,
            kv_included=exp.has_kv,
            tokens=tokens,
            generated=tokens - prompt_len,
            delta=bool(request.from_token),
        )

    @rpc_errors
    async def ImportSession(
        self, request: worker_pb2.ImportSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ImportSessionResponse:
        if not request.blob:
            raise InvalidArgument("blob must not be empty", field="blob")
        exp = await asyncio.to_thread(SessionExport.from_bytes, request.blob)
        if request.delta_for:
            return await self._apply_delta(request, exp)
        if DELTA_KEY in exp.description:
            raise InvalidArgument(
                "blob is a delta: apply it to a staged session (delta_for)", field="delta_for"
            )
        sid = str(exp.description.get("session_id", ""))
        if request.staged:
            held = await self.runner.call(
                lambda: _Held.of(self.engine.import_session(exp, staged=True))
            )
            self._staged.add(sid)
            return self._imported(exp, held, staged=True)
        feed_tokens = exp.description["tokens"][exp.description["prompt_len"] :]
        self.feeds.create(sid, feed_tokens, int(exp.description["prompt_len"]))
        try:
            # Read inside the call: once it returns, the engine may prefill the session.
            held = await self.runner.call(lambda: _Held.of(self.engine.import_session(exp)))
        except BaseException:
            self.feeds.discard(sid)
            raise
        return self._imported(exp, held, staged=False)

    async def _apply_delta(
        self, request: worker_pb2.ImportSessionRequest, delta: SessionExport
    ) -> worker_pb2.ImportSessionResponse:
        sid = request.delta_for
        schedule = not request.staged

        def apply() -> _Held:
            s = self.engine.apply_delta(sid, delta, schedule=schedule)
            if schedule:  # posted under the step lock: the feed exists before any new token
                self.loop.call_soon_threadsafe(self._create_feeds, [_feed_of(s)])
            return _Held.of(s)

        held = await self.runner.call(apply)
        if schedule:
            self._staged.discard(sid)
        return self._imported(delta, held, staged=not schedule)

    def _imported(
        self, exp: SessionExport, held: _Held, *, staged: bool
    ) -> worker_pb2.ImportSessionResponse:
        note = ""
        if exp.has_kv and not held.kv_restored:
            mismatch = self.engine.kv_mismatch(exp.platform)
            note = (
                "KV recomputed: platform differs in " + ", ".join(mismatch)
                if mismatch
                else "KV recomputed: the staged copy's KV does not reach the delta's"
            )
        return worker_pb2.ImportSessionResponse(
            session_id=held.session_id,
            kv_restored=held.kv_restored,
            kv_note=note,
            generated=held.tokens - held.prompt_len,
            staged=staged,
            tokens=held.tokens,
        )

    @rpc_errors
    async def CancelSession(
        self, request: worker_pb2.CancelSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelSessionResponse:
        session = await self.runner.call(lambda: self.engine.cancel(request.session_id))
        if request.session_id in self._staged:  # a staged copy has no client stream
            self._staged.discard(request.session_id)
        else:
            self.feeds.get(request.session_id).close("cancelled")
        return worker_pb2.CancelSessionResponse(generated=len(session.generated))

    async def _counters(self) -> Counters:
        c = await self.runner.call(self.engine.counters)  # the sample deques grow per step
        return Counters(
            prefill_tokens=c.prefill_tokens,
            decode_tokens=c.decode_tokens,
            queue_depth=c.queue_depth,
            kv_blocks_used=c.kv_blocks_used,
            kv_blocks_total=c.kv_blocks_total,
            live_sessions=c.running + c.queue_depth,
            ttft_ms=_percentiles(c.ttft_ms),
            tbt_ms=_percentiles(c.tbt_ms),
        )

    def _info_fields(self) -> dict[str, Any]:
        e = self.engine
        key = engine_key(e).to_json()
        return {
            "model_id": e.model_id,
            "compat_key": worker_pb2.WorkerCompatKey(**key),  # type: ignore[arg-type]
            "kv_block_size": e.config.block_size,
            "kv_blocks_total": e.config.num_blocks,
            "max_running": e.config.max_running,
            "compiled": e.compiled,
            "paused": self.runner.paused,
            "restored_from": self.state.restored_from,
            "staged_session_ids": sorted(self._staged),
        }
