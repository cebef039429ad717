"""Per-session token feeds on the event loop, so client streams can attach at any index.

A feed outlives its client: a session carried here by a restore or an import runs before
its client reattaches, and a client that lost its stream reattaches from the last index it
saw. Feeds are touched only on the event loop thread; the engine thread posts to them with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine import TokenEvent
from fleetshift_common.bounds import MAX_FINISHED_SESSIONS
from fleetshift_common.errors import AlreadyExists, NotFound

# How long a session that finished with no client reading it is reported as unread (the
# daemon names this worker for it, also after a daemon restart). Far longer than a client
# follows a moved session (120 s) plus a daemon restart; the feed itself may be dropped
# sooner (Feeds.keep_done), and then it is no longer reported: its tokens are gone.
UNREAD_KEPT_S = 900.0
# How long, and how many, sessions that finished here are reported for the daemon's
# output-length estimator (WorkerInfo.finished_sessions). Each agent heartbeat (every few
# seconds) repeats them and the daemon counts each session id once, so a lost or resent
# heartbeat loses or doubles nothing; only beyond MAX_FINISHED_SESSIONS finishing between two
# polls do the oldest go unreported, which thins the estimator's sample, not its mean.
FINISHED_KEPT_S = 120.0
# Finish reasons that are a session's own end: a cancelled session or one that left (moved,
# failed) says nothing about how long its output would have been.
OWN_ENDS = frozenset({"stop", "length"})


@dataclass(frozen=True)
class Finished:
    session_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    at: float  # by the feeds' clock


class Feed:
    def __init__(
        self,
        session_id: str,
        tokens: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        prompt_tokens: int = 0,
        on_finish: Callable[[Feed], None] = lambda feed: None,
    ) -> None:
        self.session_id = session_id
        self.tokens = list(tokens)  # every generated token, also those before a move
        self.prompt_tokens = prompt_tokens  # 0: not known here
        self._on_finish = on_finish
        self.finished = False
        self.finish_reason = ""
        self.closed = ""  # why the session left without finishing ("moved", "cancelled")
        self.finished_at = 0.0  # when the last token came (by ``clock``)
        self.read = False  # a client stream has been given the last token
        self._clock = clock
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
            self.finished_at = self._clock()
            self._on_finish(self)
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
    def __init__(self, keep_done: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self._feeds: OrderedDict[str, Feed] = OrderedDict()
        self._keep_done = keep_done
        self._clock = clock
        self._finished: deque[Finished] = deque(maxlen=MAX_FINISHED_SESSIONS)

    def create(self, session_id: str, tokens: Iterable[int] = (), prompt_tokens: int = 0) -> Feed:
        old = self._feeds.get(session_id)
        if old is not None and not old.done:
            raise AlreadyExists(f"session_id {session_id!r} is live here", field="session_id")
        feed = Feed(session_id, tokens, self._clock, prompt_tokens, self._record_finish)
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

    def unread_ids(self) -> list[str]:
        """Sessions that finished here and whose last token no client has been given, for
        UNREAD_KEPT_S: the worker holds tokens a client will come back for (it went away, or
        its session finished here after a move before it re-attached). The daemon keeps
        where sessions ended in memory only; this is what a restarted one relearns it from."""
        since = self._clock() - UNREAD_KEPT_S
        return [
            sid
            for sid, feed in self._feeds.items()
            if feed.finished and not feed.read and feed.finished_at >= since
        ]

    def _record_finish(self, feed: Feed) -> None:
        if feed.finish_reason in OWN_ENDS and feed.prompt_tokens > 0:
            self._finished.append(
                Finished(
                    feed.session_id,
                    feed.prompt_tokens,
                    len(feed.tokens),
                    feed.finish_reason,
                    feed.finished_at,
                )
            )

    def finished(self) -> list[Finished]:
        """Sessions that finished here by a stop token or their length within
        FINISHED_KEPT_S (the last MAX_FINISHED_SESSIONS), oldest first. A session whose prompt
        length this worker does not know (none such today) is not reported."""
        since = self._clock() - FINISHED_KEPT_S
        return [f for f in self._finished if f.at >= since]

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


async def stream(
    feed: Feed, start: int, per_message: int = 1
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """A client's stream of ``feed`` from token ``start`` on: what it holds, then live tokens
    until the session finishes or leaves. Every engine's worker serves Generate with this.

    ``per_message`` > 1 (the request's ``tokens_per_message``): one message carries up to
    that many of the tokens the feed already holds, never waiting for more, so a client's
    stream is no later than with one token per message."""
    index = start
    per_message = max(1, per_message)
    while True:
        while index < len(feed.tokens):
            end = min(len(feed.tokens), index + per_message)
            last = feed.finished and end == len(feed.tokens)
            # Given to a client stream: read (marked before the yield, as a client that has
            # what it asked for may hang up before the generator runs on).
            feed.read = feed.read or last
            yield worker_pb2.GenerateResponse(
                session_id=feed.session_id,
                token=feed.tokens[index],
                index=index,
                finished=last,
                finish_reason=feed.finish_reason if last else "",
                more_tokens=feed.tokens[index + 1 : end],
            )
            index = end
        if feed.done:
            feed.read = feed.read or feed.finished  # re-attached past the last token
            return
        await feed.changed()
