"""Which finished sessions a worker reports as unread: the daemon rebuilds where sessions
ended from this after a restart, so a client coming back is sent to the worker that holds
its tokens (tests/e2e/test_moves.py runs it end to end)."""

from __future__ import annotations

from fleetshift_agent.engine import TokenEvent
from fleetshift_agent.worker.feeds import UNREAD_KEPT_S, Feeds, stream
from tests.clock import ManualClock


def finish(feeds: Feeds, session_id: str, tokens: int = 3) -> None:
    feeds.publish(
        [TokenEvent(session_id, i, 100 + i, i == tokens - 1, "length") for i in range(tokens)]
    )


async def test_a_session_is_unread_until_a_client_is_given_its_last_token() -> None:
    clock = ManualClock(50.0)
    feeds = Feeds(clock=clock)
    for sid in ("away", "gone", "live", "read"):
        feeds.create(sid)
    finish(feeds, "away")
    finish(feeds, "read")
    feeds.get("gone").close("moved")  # left without finishing: its tokens live elsewhere
    feeds.publish([TokenEvent("live", 0, 7, False)])
    assert feeds.unread_ids() == ["away", "read"]

    # A client that stops before the last token has not read the session; one that got it has.
    partial = stream(feeds.get("read"), 0)
    assert [(await anext(partial)).index for _ in range(2)] == [0, 1]
    await partial.aclose()
    assert feeds.unread_ids() == ["away", "read"]
    assert [m.token async for m in stream(feeds.get("read"), 1)] == [101, 102]
    assert feeds.unread_ids() == ["away"]

    # Reported for UNREAD_KEPT_S after it finished, then the client is taken to be gone.
    clock.advance(UNREAD_KEPT_S)
    assert feeds.unread_ids() == ["away"]
    clock.advance(1.0)
    assert feeds.unread_ids() == []


def test_a_session_the_worker_no_longer_holds_is_not_reported() -> None:
    feeds = Feeds(keep_done=2, clock=ManualClock(0.0))
    for sid in ("s1", "s2", "s3"):
        feeds.create(sid)
        finish(feeds, sid)
    feeds.create("s4")  # the oldest ended session is dropped to make room
    assert feeds.unread_ids() == ["s2", "s3"]
