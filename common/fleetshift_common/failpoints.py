"""Failpoints: named places where a test can make a process crash or wait.

Crash-safety claims ("kill the daemon at any step of a move and nothing is lost") are only worth
something if each step is actually hit. ``FLEETSHIFT_FAILPOINTS`` holds a comma-separated list
of ``<name>=crash`` (SIGKILL this process right there) or ``<name>=hold:<file>`` (create
``<file>``, then wait until it is deleted, so a test can kill another process at that moment).
Unset in production, a failpoint costs one dictionary lookup.

``FLEETSHIFT_FAILPOINTS_FILE`` names a file holding more of the same list, read at every hit:
a test arms and disarms failpoints in a running process by writing it, instead of restarting
the process (the crash tests share one fleet between cases this way). Only tests set it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

ENV = "FLEETSHIFT_FAILPOINTS"
FILE_ENV = "FLEETSHIFT_FAILPOINTS_FILE"


def _parse(raw: str) -> dict[str, str]:
    points: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        name, _, action = item.partition("=")
        points[name] = action
    return points


class Failpoints:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._points = _parse(env.get(ENV, ""))
        self._file = Path(env[FILE_ENV]) if env.get(FILE_ENV) else None

    def _action(self, name: str) -> str | None:
        if self._file is not None:
            try:
                armed = _parse(self._file.read_text())
            except FileNotFoundError:
                armed = {}
            if name in armed:
                return armed[name]
        return self._points.get(name)

    def hit(self, name: str) -> None:
        """Blocking: call it from a thread when the caller is an event loop."""
        action = self._action(name)
        if action is None:
            return
        if action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if action.startswith("hold:"):
            marker = Path(action.removeprefix("hold:"))
            # Written aside and renamed: a watcher that sees the marker must read the name whole.
            staged = marker.with_name(marker.name + ".partial")
            staged.write_text(name)
            os.replace(staged, marker)
            while marker.exists():
                time.sleep(0.02)

    @property
    def armed(self) -> bool:
        return bool(self._points) or self._file is not None
