"""``wait_or_timeout``: the demo's and the agents' "wait for stop, at most N seconds" step.

It replaced ``asyncio.wait_for(event.wait(), N)``, which on Python 3.11 swallows a
cancellation that lands as the event is set (the pattern that hung an agent's stop in CI).
"""

from __future__ import annotations

import asyncio

import pytest

from fleetshift_common.lifecycle import wait_or_timeout


async def test_it_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_or_timeout(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_or_timeout(event, 5) is True


@pytest.mark.parametrize("yields", range(4))
async def test_a_wait_cancelled_as_its_event_is_set_ends_cancelled(yields: int) -> None:
    """The event is set and the waiter cancelled in the same loop step, ``yields`` steps in:
    a waiter still running must end cancelled, never return as if nothing had happened."""
    event = asyncio.Event()
    task = asyncio.create_task(wait_or_timeout(event, 5))
    for _ in range(yields):
        await asyncio.sleep(0)
    event.set()
    if task.cancel():
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert task.result() is True
