"""Which finished sessions a worker reports as unread: the daemon rebuilds where sessions
ended from this after a restart, so a client coming back is sent to the worker that holds
its tokens (tests/e2e/test_moves.py runs it end to end)."""

from __future__ import annotations

from fleetshift_agent.engine import TokenEvent
from fleetshift_agent.worker.feeds import FINISHED_KEPT_S, UNREAD_KEPT_S, Feeds, stream
from fleetshift_common.bounds import MAX_FINISHED_SESSIONS
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


def test_only_sessions_that_finished_by_their_own_end_are_reported_for_the_estimator() -> None:
    """The daemon's output-length estimator learns from these: a session cancelled or moved
    away says nothing about its output (a moved one finishes on its target, counted there
    with every token it generated, also those before the move)."""
    clock = ManualClock(50.0)
    feeds = Feeds(clock=clock)
    feeds.create("done", prompt_tokens=40)
    feeds.create("moved", prompt_tokens=40)
    feeds.create("cancelled", prompt_tokens=40)
    feeds.create("arrived", [1, 2, 3], prompt_tokens=9)  # imported after 3 tokens elsewhere
    feeds.create("unknown")  # no prompt length known: not reported
    finish(feeds, "done", tokens=5)
    feeds.publish([TokenEvent("moved", 0, 1, False)])
    feeds.get("moved").close("moved")
    feeds.get("cancelled").close("cancelled")
    feeds.publish([TokenEvent("arrived", 3, 4, True, "stop")])
    finish(feeds, "unknown")
    reported = [
        (f.session_id, f.prompt_tokens, f.output_tokens, f.finish_reason) for f in feeds.finished()
    ]
    assert reported == [("done", 40, 5, "length"), ("arrived", 9, 4, "stop")]
    # Repeated in every report for FINISHED_KEPT_S, then no longer.
    assert len(feeds.finished()) == 2
    clock.advance(FINISHED_KEPT_S + 1)
    assert feeds.finished() == []


def test_at_most_the_last_bound_of_finished_sessions_are_reported() -> None:
    feeds = Feeds(keep_done=10, clock=ManualClock(0.0))
    for i in range(MAX_FINISHED_SESSIONS + 5):
        feeds.create(f"s{i}", prompt_tokens=8)
        finish(feeds, f"s{i}")
    reported = feeds.finished()
    assert len(reported) == MAX_FINISHED_SESSIONS
    assert (
        reported[0].session_id == "s5"
        and reported[-1].session_id == f"s{MAX_FINISHED_SESSIONS + 4}"
    )
