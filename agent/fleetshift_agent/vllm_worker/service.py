"""``fleetshift.v1.WorkerService`` in front of a vLLM server: the same interface, vLLM behind.

The daemon, the router, the gateway and the executor speak to a vLLM worker exactly as to a
reference worker. Each session is one streaming vLLM request whose tokens feed a ``Feed``
(the reference worker's), so clients attach and re-attach at any token index with the same
semantics. What vLLM cannot do here is refused by name: snapshots (no checkpoint/restore on
this host) and a role its KV-transfer role excludes. A session's KV moves through vLLM's disk
connector where the worker has one and the compatibility key agrees (``kv``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine import TokenEvent
from fleetshift_agent.vllm_worker import kv_store
from fleetshift_agent.vllm_worker.client import VllmClient
from fleetshift_agent.vllm_worker.kv import (
    STAGED_NOTE,
    carried_tokens,
    export_carries_kv,
    key_fields,
    kv_refusal,
    nixl_tokens,
    preloaded_note,
    restored_note,
    staged_note,
)
from fleetshift_agent.vllm_worker.metrics import LatencyWindow, VllmStats, p50_p99_ms, parse_metrics
from fleetshift_agent.vllm_worker.server import NIXL_CONNECTOR
from fleetshift_agent.vllm_worker.sessions import Carried, KvRef, SessionSpec, kv_params
from fleetshift_agent.wire import ROLE_BY_NAME
from fleetshift_agent.worker.feeds import Feed, Feeds
from fleetshift_agent.worker.session_core import Counters, SessionServicer
from fleetshift_common.errors import (
    FailedPrecondition,
    FleetShiftError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from fleetshift_rpc.errors import rpc_errors

log = logging.getLogger("fleetshift.vllm_worker")

# A session held for a hand-over (hold_after_tokens) runs on by itself after this long without
# an export: its client's export follows its first token by milliseconds, and a client that
# went away ends the session anyway; this only bounds a client that never asks.
HAND_OVER_WAIT_S = 10.0

ROLES = ROLE_BY_NAME
# What vLLM's KV-transfer role (fixed when the server starts) lets a worker be.
ROLES_BY_KV_ROLE = {
    "kv_both": ("prefill", "decode", "mixed"),
    "kv_producer": ("prefill",),
    "kv_consumer": ("decode",),
}


@dataclass(frozen=True)
class VllmIdentity:
    """What GetInfo reports: the worker, its model and the key a move compares."""

    worker_id: str
    model_id: str
    compat_key: worker_pb2.WorkerCompatKey
    kv_role: str = ""  # the connector's, when one is configured
    kv_connector: str = ""
    kv_store: str = ""  # the disk connector's directory: sessions' KV travels through it
    kv_store_ttl_s: float = 600.0  # an export nobody imported is deleted after this
    nixl_side_channel: str = ""  # host:port other vLLMs pull this one's KV through (NIXL)

    @property
    def exports_kv(self) -> bool:
        """Whether ExportSession can hand a session's KV on: a disk store, or NIXL."""
        return bool(self.kv_store) or self.kv_connector == NIXL_CONNECTOR


@dataclass
class VllmState:
    role: int
    draining: bool = False
    role_epoch: int = 0
    paused: bool = False
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    specs: dict[str, SessionSpec] = field(default_factory=dict)
    staged: dict[str, Carried] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)  # live sessions without a vLLM request
    kv_load: dict[str, KvRef] = field(default_factory=dict)  # session -> the KV to load
    # staged session -> the tokens of its KV loaded ahead into vLLM's prefix cache
    preloaded: dict[str, int] = field(default_factory=dict)


class VllmWorkerServicer(SessionServicer[VllmState]):
    def __init__(
        self,
        client: VllmClient,
        identity: VllmIdentity,
        role: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.identity = identity
        self.state = VllmState(role=ROLES[role])
        self.feeds = Feeds()
        self.clock = clock
        self.wall = wall  # the store's files carry wall-clock times
        self.latency = LatencyWindow()
        self._last = VllmStats()
        self._hand_overs: set[asyncio.Future[None]] = set()  # held sessions' resume timers

    # ---- clients ------------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    async def _start_session(self, request: worker_pb2.GenerateRequest) -> Feed:
        spec = _spec(request)
        return await self._run(spec, [], hold_after=_hold_after(request, spec))

    def _client_gone(self, feed: Feed) -> None:
        self._end(feed.session_id, "cancelled")

    async def _run(self, spec: SessionSpec, generated: list[int], hold_after: int = 0) -> Feed:
        """A session that carries ``spec`` on from ``generated``: its vLLM request starts now
        (returning once vLLM accepted it; a refusal raises here, leaving nothing behind), or
        at Resume when the worker is paused. With ``hold_after`` its first request stops after
        that many tokens and the session is held for a hand-over (see ``_pump``)."""
        feed = self.feeds.create(spec.session_id, generated, len(spec.prompt))
        if self.state.paused:
            self.state.held.add(spec.session_id)
        else:
            try:
                await self._launch(spec, feed, hold_after)
            except BaseException:
                self.feeds.discard(spec.session_id)
                raise
        self.state.specs[spec.session_id] = spec
        return feed

    async def _launch(self, spec: SessionSpec, feed: Feed, hold_after: int = 0) -> None:
        """Start the vLLM request that continues ``feed``; returns once vLLM accepted it.
        The first request of a session imported with its KV loads that KV from the store;
        once it has its first token the KV is in vLLM, and the store's folder goes."""
        kv_load = self.state.kv_load.pop(spec.session_id, None)
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pump = self._pump(spec, feed, accepted, kv_load, hold_after)
        task = asyncio.create_task(pump, name=spec.session_id)
        try:
            await accepted
        except BaseException:
            task.cancel()
            raise
        finally:
            if kv_load is not None and kv_load.id:  # a disk export (NIXL's have no id): single-use
                await asyncio.to_thread(kv_store.remove, self.identity.kv_store, kv_load.id)
        self.state.tasks[spec.session_id] = task
        task.add_done_callback(lambda _: self._forget(spec.session_id, task))
        if self.state.paused:  # paused while vLLM was taking it: hold it with the rest
            self._hold(spec.session_id)

    async def _pump(
        self,
        spec: SessionSpec,
        feed: Feed,
        accepted: asyncio.Future[None],
        kv_load: KvRef | None = None,
        hold_after: int = 0,
    ) -> None:
        """Feed the session the tokens of one vLLM request. A request cut short by
        ``hold_after`` that ends by its length holds the session instead of finishing it: the
        prefill side of a split answer stops at its first token, so the hand-over's export
        finds it live however fast the engine decodes (it resumes by itself if none comes)."""
        base = len(feed.tokens)
        index = base
        completion = spec.completion(feed.tokens[:base], kv_load)
        cut = 0 < hold_after < completion.max_tokens
        if cut:
            completion = replace(completion, max_tokens=hold_after)
        try:
            async for chunks in self.client.stream(completion):
                if not accepted.done():
                    accepted.set_result(None)
                for chunk in chunks:
                    ends = chunk.finish_reason and not (cut and chunk.finish_reason == "length")
                    for n, token in enumerate(chunk.tokens):
                        last = bool(ends) and n == len(chunk.tokens) - 1
                        reason = chunk.finish_reason if last else ""
                        feed.push(TokenEvent(spec.session_id, index, token, last, reason))
                        index += 1
                    if cut and chunk.finish_reason == "length" and not feed.done:
                        self._hold_for_hand_over(spec, feed)
                        return
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

    def _hold_for_hand_over(self, spec: SessionSpec, feed: Feed) -> None:
        """Hold a session its client asked to stop early (``hold_after_tokens``) until its
        export; should none come within ``HAND_OVER_WAIT_S`` it runs on here."""
        self.state.held.add(spec.session_id)
        waiting = asyncio.ensure_future(self._resume_unclaimed(spec, feed))
        self._hand_overs.add(waiting)
        waiting.add_done_callback(self._hand_overs.discard)

    async def _resume_unclaimed(self, spec: SessionSpec, feed: Feed) -> None:
        await asyncio.sleep(HAND_OVER_WAIT_S)
        sid = spec.session_id
        if sid not in self.state.held or self.state.paused or feed.done:
            return  # exported, ended, or paused (Resume starts it with the rest)
        if sid in self.state.tasks:
            return
        log.info("session %s: no hand-over within %.0f s; it runs on here", sid, HAND_OVER_WAIT_S)
        self.state.held.discard(sid)
        try:
            await self._launch(spec, feed)
        except FleetShiftError as err:
            feed.close(f"engine failed: {err.message}")

    def _forget(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self.state.tasks.get(session_id) is task:
            del self.state.tasks[session_id]

    def _end(self, session_id: str, why: str) -> list[int]:
        """Stop the session's vLLM request now (vLLM aborts it when the stream closes) and
        close its feed; the tokens it had. Synchronous on the loop: no token lands after."""
        self.state.held.discard(session_id)
        self.state.kv_load.pop(session_id, None)  # its export's folder goes with the TTL
        task = self.state.tasks.pop(session_id, None)
        if task is not None:
            task.cancel()
        feed = self.feeds.get(session_id)
        feed.close(why)
        return list(feed.tokens)

    def _hold(self, session_id: str) -> None:
        """End the session's vLLM request but keep the session: its feed stays open with
        the tokens it has, and Resume (or an export's end) starts a request that continues
        it, vLLM's prefix cache holding its context. Synchronous on the loop: no token of
        the ended request lands after this."""
        task = self.state.tasks.pop(session_id, None)
        if task is not None:
            task.cancel()
            self.state.held.add(session_id)

    async def _release_held(self) -> None:
        """Start a request for every held session (Resume)."""
        for sid in sorted(self.state.held):
            if self.state.paused:
                return  # paused again meanwhile: the rest stay held
            self.state.held.discard(sid)
            feed, spec = self.feeds.get(sid), self.state.specs.get(sid)
            if feed.done or spec is None:
                continue
            try:
                await self._launch(spec, feed)
            except FleetShiftError as err:
                feed.close(f"engine failed: {err.message}")

    # ---- control ------------------------------------------------------------------------

    async def _run_state(self) -> worker_pb2.WorkerRunState:
        stats = await self._stats()
        return worker_pb2.WorkerRunState(paused=self.state.paused, steps=stats.steps)

    @rpc_errors
    async def Pause(
        self, request: worker_pb2.WorkerPauseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRunState:
        """Hold every session where it stands. Their vLLM requests end (vLLM keeps their KV
        in its prefix cache) rather than freezing inside a paused vLLM, so the server still
        serves what a move asks of it while paused: the prefill that hands a session's KV
        to the disk connector (ExportSession with_kv)."""
        self.state.paused = True
        for sid in list(self.state.tasks):
            self._hold(sid)
        # The steps as of the last read of vLLM's statistics, not a fresh one: a move's Pause
        # sits inside every carried session's pause, and a /metrics read took 14-80 ms here
        # (docs/benchmarks.md, 2026-12-05 evening). Nobody steps a vLLM worker by count.
        return worker_pb2.WorkerRunState(paused=True, steps=self._last.steps)

    @rpc_errors
    async def Resume(
        self, request: worker_pb2.WorkerResumeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerRunState:
        if request.steps:
            raise FailedPrecondition(
                "steps: vLLM cannot single-step; resume without steps", field="steps"
            )
        self.state.paused = False
        await self._release_held()
        return await self._run_state()

    @rpc_errors
    async def Snapshot(
        self, request: worker_pb2.WorkerSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerSnapshotResponse:
        raise FailedPrecondition(
            "snapshot_id: a vLLM worker has no snapshot on this host (vLLM's checkpoint/restore "
            "needs CRIU and cuda-checkpoint); move it cold: its sessions carry their KV where "
            "a disk KV connector is configured, else their token history",
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
        feed = self._live_feed(request.session_id)
        spec = self.state.specs.get(request.session_id)
        if spec is None:
            raise FailedPrecondition(
                f"session_id {request.session_id!r} has ended "
                f"({feed.finish_reason or feed.closed})",
                field="session_id",
            )
        kv = None
        generated = list(feed.tokens)
        i, length = self.identity, len(spec.prompt) + len(generated)
        if (
            request.with_kv
            and i.exports_kv
            and export_carries_kv(
                i.kv_connector, request.from_token, request.release, self.state.paused, length
            )
        ):
            generated, kv = await self._store_kv(spec, feed, hold=request.release)
        if request.release:
            self._end(feed.session_id, "moved")
        return worker_pb2.ExportSessionResponse(
            blob=spec.to_blob(generated, delta=bool(request.from_token), kv=kv),
            kv_included=kv is not None,
            tokens=len(spec.prompt) + len(generated),
            generated=len(generated),
            delta=bool(request.from_token),
        )

    async def _store_kv(
        self, spec: SessionSpec, feed: Feed, *, hold: bool
    ) -> tuple[list[int], KvRef | None]:
        """Hand the session's KV to the connector: prefill its context once more (vLLM's
        prefix cache holds it: only the last partial block is computed), which makes the
        disk connector store it (or vLLM keep it for a NIXL pull). Returns the tokens the KV
        belongs to, and where it is (None: shorter than one block). With ``hold`` (the
        session leaves) its tokens stop where they are first; without (a pre-copy) the
        session decodes on beside the export, which takes the context as it stood."""
        if hold:
            self._hold(spec.session_id)
        generated = list(feed.tokens)
        if self.identity.kv_connector == NIXL_CONNECTOR:
            return generated, await self._offer_kv(spec, generated)
        export_id = kv_store.new_id()
        block = self._last.block_size or (await self._stats()).block_size
        tokens = carried_tokens(len(spec.prompt) + len(generated), block)
        if not tokens:
            return generated, None
        await self.sweep_store()  # every export also clears what nobody imported
        store = spec.kv_completion(generated, kv_params("store", export_id))
        async for _ in self.client.stream(store):
            pass
        i = self.identity
        return generated, KvRef(i.kv_connector, i.kv_store, tokens, self._key, export_id)

    async def _offer_kv(self, spec: SessionSpec, generated: list[int]) -> KvRef:
        """NIXL: prefill the context once more asking vLLM to keep its blocks for a remote
        decode (its prefix cache holds them: only the tail is computed); vLLM answers where
        another vLLM pulls them from. It frees them once pulled, or when their lease ends
        (``kv_lease_duration``, the store's TTL: ``server.kv_transfer_config``) if no
        destination comes (a move rolled back)."""
        params = await self.client.prefill_for_transfer(
            spec.kv_completion(generated, {"do_remote_decode": True})
        )
        i = self.identity
        tokens = nixl_tokens(params, len(spec.prompt) + len(generated))
        return KvRef(i.kv_connector, i.nixl_side_channel, tokens, self._key, "", params)

    async def sweep_store(self) -> int:
        """Delete the store's exports older than the TTL (nobody imported them)."""
        i = self.identity
        if not i.kv_store:
            return 0
        return await asyncio.to_thread(kv_store.sweep, i.kv_store, i.kv_store_ttl_s, self.wall())

    async def sweep_store_forever(self) -> None:
        """The store's TTL sweep, a few times per TTL, for as long as the worker runs."""
        while True:
            await asyncio.sleep(max(1.0, self.identity.kv_store_ttl_s / 4))
            try:
                await self.sweep_store()
            except OSError as err:  # a store that is briefly unreachable: try again later
                log.warning("KV store sweep failed: %s", err)

    @property
    def _key(self) -> dict[str, str | int]:
        return key_fields(self.identity.compat_key)

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
            staged = self.state.staged[sid]
            if carried.generated[: len(staged.generated)] != staged.generated:
                raise FailedPrecondition(
                    "from_token: the delta does not continue the staged session's tokens",
                    field="from_token",
                )
            carried = await self._on_staged(staged, carried)
        elif carried.delta:
            raise InvalidArgument(
                "blob is a delta: apply it to a staged session (delta_for)", field="delta_for"
            )
        restored, note = False, STAGED_NOTE
        if request.staged:
            before = self.state.staged.get(sid)
            self.state.staged[sid] = carried
            if carried.kv is not None and (before is None or before.kv != carried.kv):
                restored, note = await self._preload(carried)  # into vLLM now, not at the switch
        else:
            self.state.staged.pop(sid, None)
            restored, note = await self._start_carried(carried)
            log.info("session %s imported: %s", sid, note)  # which path its KV took
        return worker_pb2.ImportSessionResponse(
            session_id=sid,
            kv_restored=restored,
            kv_note=note,
            generated=len(carried.generated),
            staged=request.staged,
            tokens=len(carried.spec.prompt) + len(carried.generated),
        )

    async def _preload(self, carried: Carried) -> tuple[bool, str]:
        """Load a staged session's KV ahead: a one-token request over the staged context
        makes the disk connector load the export's blocks into this vLLM, whose prefix cache
        keeps them, so the request that starts the session after its final delta finds them
        here and the pause waits for no load. The export's folder stays until that request
        (should vLLM evict the blocks meanwhile, it loads them again). Not over NIXL: the
        offer is pulled once, at the final import."""
        kv = carried.kv
        if kv is None or kv.connector == NIXL_CONNECTOR or self._refusal(kv):
            return False, STAGED_NOTE
        sid = carried.spec.session_id
        request = carried.spec.kv_completion(carried.generated, kv.load_params())
        try:
            before = await self._stats()
            async for _ in self.client.stream(request):
                pass
            after = await self._stats()
        except FleetShiftError as err:  # the final import loads it instead
            log.warning("session %s: loading its staged KV ahead failed: %s", sid, err.message)
            return False, STAGED_NOTE
        loaded = after.external_prefix_cache_hits - before.external_prefix_cache_hits
        self.state.preloaded[sid] = loaded
        context = len(carried.spec.prompt) + len(carried.generated)
        return loaded > 0, staged_note(kv, context, loaded)

    async def _on_staged(self, staged: Carried, delta: Carried) -> Carried:
        """A delta applied to its staged copy: a delta without KV of its own (the disk
        connector's) keeps the staged export's; one with its own (NIXL's final offer)
        replaces it, and a replaced disk export's folder goes."""
        if delta.kv is None:
            return replace(delta, kv=staged.kv)
        if staged.kv is not None and staged.kv.id and staged.kv.id != delta.kv.id:
            await self._drop_export(staged.kv)
        return delta

    async def _drop_export(self, kv: KvRef) -> None:
        """Delete a disk export nobody will import (single-use folders; NIXL's have no id)."""
        if kv.id and self.identity.kv_store and kv.store == self.identity.kv_store:
            await asyncio.to_thread(kv_store.remove, self.identity.kv_store, kv.id)

    async def _start_carried(self, carried: Carried) -> tuple[bool, str]:
        """Start a carried session; whether vLLM took its KV from the connector, and the
        note that says which path it took. The KV's arrival is vLLM's own count (external
        prefix-cache hits) across the start, so a KV that was offered but not found reads
        as recomputed, never as restored (imports come one at a time from the executor).
        A session whose KV vLLM loaded while it was staged (``_preload``) was counted then;
        its start reads no /metrics, which would sit inside the session's pause."""
        refusal = self._refusal(carried.kv)
        if refusal or carried.kv is None:
            if carried.kv is not None:
                await self._drop_export(carried.kv)  # unusable here
            await self._run(carried.spec, carried.generated)
            return False, refusal
        sid = carried.spec.session_id
        self.state.kv_load[sid] = carried.kv
        if self.state.paused:  # its first request, at Resume, loads the KV
            self.state.preloaded.pop(sid, None)
            await self._run(carried.spec, carried.generated)
            return False, "KV recomputed: the worker is paused (loaded at resume, not counted)"
        context = len(carried.spec.prompt) + len(carried.generated)
        ahead = self.state.preloaded.pop(sid, 0)
        if ahead > 0:  # counted when it was loaded, outside the pause: not again inside it
            await self._run(carried.spec, carried.generated)
            return True, preloaded_note(carried.kv, context, ahead)
        before = await self._stats()
        await self._run(carried.spec, carried.generated)
        after = await self._stats()
        loaded = after.external_prefix_cache_hits - before.external_prefix_cache_hits
        local = after.prefix_cache_hits - before.prefix_cache_hits
        return loaded > 0, restored_note(carried.kv, context, loaded, local)

    def _refusal(self, kv: KvRef | None) -> str:
        """Why this worker does not take ``kv`` (a note beginning "KV recomputed"), or "":
        the key and store rules (``kv_refusal``), then the export's age (``_stale``)."""
        i = self.identity
        refusal = kv_refusal(kv, i.kv_connector, i.kv_store, self._key)
        if not refusal and kv is not None:
            refusal = self._stale(kv)
        return refusal

    def _stale(self, kv: KvRef) -> str:
        """Why an export's KV is not taken although it may travel: it has no id (a blob
        from before exports had one), or it is old enough that a TTL sweep may delete it
        while vLLM reads it (the engine cannot survive a file vanishing mid-load). NIXL's
        blocks wait in the source's vLLM, which frees them on its own timeout: a pull after
        it finds none and reads as recomputed by vLLM's own count."""
        if kv.connector == NIXL_CONNECTOR:
            return ""
        if not kv_store.ID.match(kv.id):
            return "KV recomputed: the blob's KV names no export id"
        age = kv_store.age_s(self.identity.kv_store, kv.id, self.wall())
        if age is not None and age > self.identity.kv_store_ttl_s / 2:
            return (
                f"KV recomputed: the export is {age:.0f} s old, past half the store's TTL "
                f"({self.identity.kv_store_ttl_s:.0f} s); a sweep may delete it"
            )
        return ""

    @rpc_errors
    async def CancelSession(
        self, request: worker_pb2.CancelSessionRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelSessionResponse:
        staged = self.state.staged.pop(request.session_id, None)
        self.state.preloaded.pop(request.session_id, None)
        if staged is not None:
            if staged.kv is not None:
                await self._drop_export(staged.kv)  # a rolled-back move's pre-copy
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

    async def _counters(self) -> Counters:
        stats = await self._stats()
        ttft, tbt = self.latency.add(self.clock(), stats)
        used, total = stats.daemon_blocks()
        return Counters(
            prefill_tokens=stats.prompt_tokens,
            decode_tokens=stats.generation_tokens,
            queue_depth=stats.waiting,
            kv_blocks_used=used,
            kv_blocks_total=total,
            live_sessions=stats.running + stats.waiting,
            ttft_ms=p50_p99_ms(ttft),
            tbt_ms=p50_p99_ms(tbt),
        )

    def _info_fields(self) -> dict[str, Any]:
        return {
            "model_id": self.identity.model_id,
            "compat_key": self.identity.compat_key,
            "kv_block_size": self._last.block_size,
            "kv_blocks_total": self._last.kv_blocks,
            "compiled": False,
            "paused": self.state.paused,
            "staged_session_ids": sorted(self.state.staged),
        }

    def _check_role(self, role: str) -> None:
        check_role(role, self.identity.kv_role)

    async def close(self) -> None:
        """Stop every session; the exports this worker staged go too (each folder is
        single-use and only this worker would have imported it: a move rolled back after
        its pre-copy stops the target, and the store would keep them until the TTL)."""
        for task in list(self.state.tasks.values()):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self.state.tasks.values(), return_exceptions=True)
        self.feeds.close_all("worker stopped")
        for carried in list(self.state.staged.values()):
            if carried.kv is not None:
                with contextlib.suppress(OSError):
                    await self._drop_export(carried.kv)
        self.state.staged.clear()


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


def _hold_after(request: worker_pb2.GenerateRequest, spec: SessionSpec) -> int:
    """The tokens to stop after for a hand-over (0: run to the end). One that would not stop
    before the session's own end changes nothing."""
    hold = request.hold_after_tokens
    return hold if 0 < hold < spec.max_new_tokens else 0


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
