"""Blocking work (SQL, the solver) run from the event loop, and never abandoned half-way.

``asyncio.to_thread`` cannot interrupt its thread: a task cancelled while it waits for one
stops waiting, but the thread goes on, and its write can land after the daemon has disposed
of the database. ``in_thread`` lets the thread finish before the cancellation goes on, so
"stop cancels and awaits every background task" also means "no write after dispose".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def in_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])  # the thread cannot be stopped: let it end its write
        raise
