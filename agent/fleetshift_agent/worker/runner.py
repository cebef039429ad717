"""Runs the engine on its own thread and gives control calls a step boundary.

The engine is synchronous and not thread-safe. One thread steps it in a loop; every control
call (add a session, pause, snapshot, export) runs under the same lock, so it always sees the
engine between two steps. A control call that is waiting holds the loop back, so a busy
engine cannot starve it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from fleetshift_agent.engine import Engine, TokenEvent
from fleetshift_common.errors import Unavailable

T = TypeVar("T")
log = logging.getLogger("fleetshift.worker")


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        publish: Callable[[list[TokenEvent]], None],
        on_failure: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self.engine = engine
        self._publish = publish
        self._on_failure = on_failure
        self.failure: BaseException | None = None
        self._cv = threading.Condition()
        self._waiting_control = 0
        self._count_lock = threading.Lock()  # not the step lock: counting must not wait
        self._paused = False
        self._steps_left: int | None = None  # a bounded resume pauses again after this many
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)

    @property
    def paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def _runnable(self) -> bool:
        if self._stopped:
            return True
        return not self._waiting_control and not self._paused and self.engine.has_work()

    def _loop(self) -> None:
        try:
            self._steps()
        except Exception as exc:  # a failed step must not leave every client hanging
            log.exception("engine step failed; the worker stops serving")
            self.failure = exc
            self._on_failure(exc)

    def _steps(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._runnable)
                if self._stopped:
                    return
                events = self.engine.step()
                if events:
                    self._publish(events)  # under the lock: ordered before any control call
                if self._steps_left is not None:
                    self._steps_left -= 1
                    if self._steps_left <= 0:
                        self._paused, self._steps_left = True, None

    def call_blocking(self, fn: Callable[[], T]) -> T:
        if self.failure is not None:
            raise Unavailable(f"engine failed: {self.failure!r}")
        with self._count_lock:
            self._waiting_control += 1
        with self._cv:
            try:
                return fn()
            finally:
                with self._count_lock:
                    self._waiting_control -= 1
                self._cv.notify_all()

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` between two steps, off the event loop."""
        return await asyncio.to_thread(self.call_blocking, fn)

    def set_paused(self, paused: bool, *, steps: int = 0) -> int:
        """Must run inside ``call``: returns the step count at the boundary.

        Resuming with ``steps`` > 0 runs that many steps and pauses again (single-stepping,
        for tests and for an operator inspecting a worker).
        """
        self._paused = paused
        self._steps_left = steps if (not paused and steps > 0) else None
        return self.engine.steps
