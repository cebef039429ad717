"""Per-session token feeds on the event loop, so client streams can attach at any index.

A feed outlives its client: a session carried here by a restore or an import runs before
its client reattaches, and a client that lost its stream reattaches from the last index it
saw. Feeds are touched only on the event loop thread; the engine thread posts to them with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine import TokenEvent
from fleetshift_common.errors import AlreadyExists, NotFound


class Feed:
    def __init__(self, session_id: str, tokens: Iterable[int] = ()) -> None:
        self.session_id = session_id
        self.tokens = list(tokens)
        self.finished = False
        self.finish_reason = ""
        self.closed = ""  # why the session left without finishing ("moved", "cancelled")
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.finished or bool(self.closed)

    def push(self, ev: TokenEvent) -> None:
        if self.done or ev.index != len(self.tokens):
            return
        self.tokens.append(ev.token)
        if ev.finished:
            self.finished = True
            self.finish_reason = ev.finish_reason
        self._wake()

    def close(self, why: str) -> None:
        if not self.done:
            self.closed = why
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


class Feeds:
    def __init__(self, keep_done: int = 4096) -> None:
        self._feeds: OrderedDict[str, Feed] = OrderedDict()
        self._keep_done = keep_done

    def create(self, session_id: str, tokens: Iterable[int] = ()) -> Feed:
        old = self._feeds.get(session_id)
        if old is not None and not old.done:
            raise AlreadyExists(f"session_id {session_id!r} is live here", field="session_id")
        feed = Feed(session_id, tokens)
        self._feeds[session_id] = feed
        self._feeds.move_to_end(session_id)
        self._trim()
        return feed

    def get(self, session_id: str, field: str = "session_id") -> Feed:
        feed = self._feeds.get(session_id)
        if feed is None:
            raise NotFound(f"{field}: no session {session_id!r} on this worker", field=field)
        return feed

    def discard(self, session_id: str) -> None:
        self._feeds.pop(session_id, None)

    def live_ids(self) -> list[str]:
        """Sessions that have neither finished nor left, oldest first."""
        return [sid for sid, feed in self._feeds.items() if not feed.done]

    def close_all(self, why: str) -> None:
        for feed in self._feeds.values():
            feed.close(why)

    def publish(self, events: list[TokenEvent]) -> None:
        for ev in events:
            feed = self._feeds.get(ev.session_id)
            if feed is not None:
                feed.push(ev)

    def _trim(self) -> None:
        done = [sid for sid, f in self._feeds.items() if f.done]
        for sid in done[: max(0, len(done) - self._keep_done)]:
            del self._feeds[sid]


async def stream(feed: Feed, start: int) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """A client's stream of ``feed`` from token ``start`` on: what it holds, then live tokens
    until the session finishes or leaves. Every engine's worker serves Generate with this."""
    index = start
    while True:
        while index < len(feed.tokens):
            last = feed.finished and index == len(feed.tokens) - 1
            yield worker_pb2.GenerateResponse(
                session_id=feed.session_id,
                token=feed.tokens[index],
                index=index,
                finished=last,
                finish_reason=feed.finish_reason if last else "",
            )
            index += 1
        if feed.done:
            return
        await feed.changed()
