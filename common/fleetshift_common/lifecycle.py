"""Process lifecycle helpers: port files and stop signals.

Tests and local fleets start processes on port 0; the bound port is written atomically to a
file so a reader never sees a half-written number.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path


def write_port_file(path: str, port: int) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, for a graceful shutdown of the running loop."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


async def wait_or_timeout(event: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``event``; True if it was set.

    ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` returns the
    inner result when it completes as the caller is cancelled, which swallows the
    cancellation, and a loop around it runs on after its task was cancelled."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
