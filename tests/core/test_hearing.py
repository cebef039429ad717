"""The liveness clock leaves out the daemon's own stalls (core/hearing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fleetshift_daemon.core.hearing import HearingClock


def test_a_stall_does_not_advance_the_clock_while_it_lasts_or_after() -> None:
    wall = [100.0]
    hearing = HearingClock(lambda: wall[0], tick_s=0.1, tolerance_s=0.05, monotonic=lambda: wall[0])
    hearing.tick()
    for t in np.arange(100.1, 101.0, 0.1):  # an ordinary busy loop: ticks a few ms late
        wall[0] = float(t) + 0.004
        hearing.tick()
    before = hearing()
    assert before == pytest.approx(wall[0])  # nothing deaf yet
    wall[0] += 3.0  # the loop stalls: no tick for 3 s
    assert hearing() == pytest.approx(before + 0.15)  # frozen beyond the allowance, mid-stall
    hearing.tick()  # the stall ended
    assert hearing() == pytest.approx(before + 0.15)
    assert hearing.deaf_s == pytest.approx(3.0 - 0.15)
    wall[0] += 0.1
    hearing.tick()
    assert hearing() == pytest.approx(before + 0.25)  # ticking on time again: it advances


def test_before_the_first_tick_it_is_the_wall_clock() -> None:
    wall = [5.0]
    hearing = HearingClock(lambda: wall[0], monotonic=lambda: wall[0])
    wall[0] = 50.0
    assert hearing() == 50.0 and hearing.deaf_s == 0.0


def test_the_daemons_clock_jumping_is_time_passing_not_a_stall() -> None:
    """A test's manual clock (or a wall clock stepped forward) moves without the loop having
    stalled: only the monotonic clock's gaps between ticks count as deafness."""
    wall, mono = [100.0], [7.0]
    hearing = HearingClock(lambda: wall[0], monotonic=lambda: mono[0])
    hearing.tick()
    wall[0] += 6.0
    mono[0] += 0.1
    hearing.tick()
    assert hearing() == 106.0 and hearing.deaf_s == 0.0
