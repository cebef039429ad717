"""Stopping a daemon in the middle of a planning pass: nothing writes after dispose.

The planning pass holds at the ``during:planning`` failpoint (inside its thread, before the
cycle writes its efficiency sample) while the test stops the daemon. stop() must wait for the
pass, and the database engine must see no statement after it was disposed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, func, select

from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.store.models import EfficiencySampleRow


async def test_stop_during_a_planning_pass_waits_for_it_and_nothing_writes_after_dispose(
    tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "planning.hold"
    monkeypatch.setenv("FLEETSHIFT_FAILPOINTS", f"during:planning=hold:{marker}")
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        liveness_check_interval_s=0.05,
        models=(ModelConfig(name="llama-70b", preset="llama2-70b", tp_options=(4,)),),
        planner=PlannerSettings(interval_s=0.1),
    )
    daemon = Daemon(config)
    await daemon.start()
    assert daemon.engine is not None
    events: list[str] = []
    event.listen(daemon.engine, "before_cursor_execute", lambda *a, **k: events.append("sql"))
    event.listen(daemon.engine, "engine_disposed", lambda *a: events.append("disposed"))

    deadline = time.monotonic() + 30
    while not marker.exists():  # the pass is inside its thread, holding
        assert time.monotonic() < deadline, "the planning pass never ran"
        await asyncio.sleep(0.02)
    running = {t.get_name() for t in asyncio.all_tasks()}
    assert "fleetshiftd planning pass" in running
    stopping = asyncio.create_task(daemon.stop(0.1))
    await asyncio.sleep(0.5)
    assert not stopping.done(), "stop() did not wait for the planning pass"
    marker.unlink()  # the pass goes on: its cycle writes the efficiency sample
    await asyncio.wait_for(stopping, 30)

    assert "disposed" in events
    assert events[events.index("disposed") + 1 :] == [], "a statement ran after dispose"
    assert {t.get_name() for t in asyncio.all_tasks()} & {
        "fleetshiftd planning pass",
        "fleetshiftd liveness sweep",
    } == set()
    check = create_engine(sqlite_url)
    with check.connect() as conn:  # the pass finished its write before the engine went
        assert conn.execute(select(func.count()).select_from(EfficiencySampleRow)).scalar() == 1
    check.dispose()
