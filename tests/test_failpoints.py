"""Failpoints armed in a running process through ``FLEETSHIFT_FAILPOINTS_FILE``: the crash
tests share one fleet between cases by writing the file instead of restarting processes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fleetshift_common.failpoints import ENV, FILE_ENV, Failpoints


def hold_in_thread(points: Failpoints, name: str) -> threading.Thread:
    thread = threading.Thread(target=points.hit, args=(name,), daemon=True)
    thread.start()
    return thread


def test_a_file_arms_and_disarms_a_failpoint_while_the_process_runs(tmp_path: Path) -> None:
    armed, marker = tmp_path / "failpoints", tmp_path / "held"
    points = Failpoints({FILE_ENV: str(armed)})
    assert points.armed  # a process given the file must look at it at every hit
    points.hit("after:switched")  # no file yet: nothing happens

    armed.write_text(f"after:switched=hold:{marker}")
    held = hold_in_thread(points, "after:switched")
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the failpoint armed by the file did not hold"
        time.sleep(0.01)
    assert held.is_alive() and marker.read_text() == "after:switched"
    marker.unlink()
    held.join(10)
    assert not held.is_alive()

    armed.write_text("")  # disarmed: the same hit passes through
    points.hit("after:switched")
    assert not marker.exists()


def test_the_file_adds_to_what_the_environment_armed(tmp_path: Path) -> None:
    armed, marker = tmp_path / "failpoints", tmp_path / "held"
    points = Failpoints({ENV: f"during:planning=hold:{marker}", FILE_ENV: str(armed)})
    armed.write_text("after:done=hold:elsewhere")
    held = hold_in_thread(points, "during:planning")
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the environment's failpoint was lost"
        time.sleep(0.01)
    marker.unlink()
    held.join(10)
    assert not held.is_alive()


def test_unset_costs_nothing_and_arms_nothing() -> None:
    points = Failpoints({})
    assert not points.armed
    points.hit("after:switched")
