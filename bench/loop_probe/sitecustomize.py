"""Bench-only probe, loaded by ``bench/load_heartbeats_routes.py --probe`` through PYTHONPATH
into each daemon it starts: where does a Route call's tail come from inside the daemon?

- **event-loop lag**: a task that asks to wake every 5 ms records how late it woke (a stall of
  the loop Route, heartbeats and the servicers share: a long callback, a blocking call);
- **GC pauses**: ``gc.callbacks`` time every collection, by generation.

Both are stamped with ``time.time()`` (comparable with the load generator's on one host) and
written every 2 s to ``$FLEETSHIFT_PROBE_OUT.<pid>.json``. Nothing happens without that
variable, so a stray import costs nothing.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time

_OUT = os.environ.get("FLEETSHIFT_PROBE_OUT")
TICK_S = 0.005
KEEP_OVER_S = 0.002  # lags shorter than this are counted, not kept

if _OUT:
    _lags: list[tuple[float, float]] = []
    _gcs: list[tuple[float, int, float]] = []
    _ticks = [0]
    _gc_start: dict[str, float] = {}

    def _on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _gc_start["t"] = time.perf_counter()
        elif "t" in _gc_start:
            took = time.perf_counter() - _gc_start.pop("t")
            _gcs.append((time.time(), int(info.get("generation", -1)), took))

    gc.callbacks.append(_on_gc)

    async def _lag_probe() -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late = time.perf_counter() - asked - TICK_S
            _ticks[0] += 1
            if late > KEEP_OVER_S:
                _lags.append((time.time(), late))

    def _dump() -> None:
        path = f"{_OUT}.{os.getpid()}.json"
        while True:
            time.sleep(2.0)
            data = {"ticks": _ticks[0], "lags": list(_lags), "gcs": list(_gcs)}
            with open(path + ".tmp", "w") as f:
                json.dump(data, f)
            os.replace(path + ".tmp", path)

    _original = asyncio.base_events.BaseEventLoop.run_forever
    _started: list[bool] = []

    def _run_forever(self: asyncio.AbstractEventLoop) -> None:
        if not _started:  # the daemon's own loop (asyncio.run's), the first to run
            _started.append(True)
            self.create_task(_lag_probe())
            threading.Thread(target=_dump, daemon=True, name="loop-probe").start()
        _original(self)  # type: ignore[arg-type]

    asyncio.base_events.BaseEventLoop.run_forever = _run_forever  # type: ignore[method-assign]
