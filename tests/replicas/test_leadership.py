"""The lease state machine on a hand-moved clock: when a replica leads, and when it must stop."""

from __future__ import annotations

import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.leadership import (
    Deposed,
    Leadership,
    LeaseSettings,
    LeaseView,
    Transition,
)
from tests.clock import ManualClock

SETTINGS = LeaseSettings(ttl_s=5.0, renew_interval_s=1.0, renew_deadline_s=3.5)


def mine(token: int) -> LeaseView:
    return LeaseView("me", "127.0.0.1:1", token, held_by_me=True)


def theirs(token: int) -> LeaseView:
    return LeaseView("other", "127.0.0.1:2", token, held_by_me=False)


def replica(clock: ManualClock) -> Leadership:
    return Leadership("me", "127.0.0.1:1", SETTINGS, clock)


def test_a_granted_attempt_elects_and_the_token_is_the_lease_token() -> None:
    clock = ManualClock(100.0)
    ld = replica(clock)
    assert not ld.acting() and ld.token() is None
    assert ld.observed(mine(7), attempt_started=100.0) is Transition.ELECTED
    assert ld.acting() and ld.token() == 7 and ld.require_token() == 7


def test_the_leader_stops_at_the_renew_deadline_counted_from_the_attempt_start() -> None:
    clock = ManualClock(100.0)
    ld = replica(clock)
    started = clock()
    clock.advance(0.4)  # the database took 0.4 s to answer
    ld.observed(mine(1), started)
    clock.t = started + SETTINGS.renew_deadline_s - 0.001
    assert ld.acting() and ld.check() is Transition.NONE
    clock.t = started + SETTINGS.renew_deadline_s
    assert not ld.acting()  # stops acting before the others' view of expiry (started + TTL)
    assert ld.token() is None
    with pytest.raises(Deposed, match="does not lead"):
        ld.require_token()
    assert ld.check() is Transition.DEPOSED


def test_renewals_extend_acting_and_failures_do_not() -> None:
    clock = ManualClock(0.0)
    ld = replica(clock)
    ld.observed(mine(3), 0.0)
    for t in (1.0, 2.0, 3.0):
        clock.t = t
        assert ld.observed(mine(3), t) is Transition.NONE
    clock.t = 4.0
    assert ld.failed() is Transition.NONE  # database unreachable: acts until 3.0 + 3.5
    clock.t = 6.49
    assert ld.acting()
    clock.t = 6.5
    assert ld.failed() is Transition.DEPOSED and not ld.acting()


def test_an_answer_that_arrives_after_the_deadline_does_not_elect() -> None:
    clock = ManualClock(0.0)
    ld = replica(clock)
    clock.t = 4.0  # the grant took longer than the renew deadline to come back
    assert ld.observed(mine(1), attempt_started=0.0) is Transition.NONE
    assert not ld.acting()


def test_another_holder_deposes_and_is_remembered_as_the_leader() -> None:
    clock = ManualClock(0.0)
    ld = replica(clock)
    assert ld.observed(theirs(4), 0.0) is Transition.NONE
    assert ld.leader_address == "127.0.0.1:2" and not ld.acting()
    ld.observed(mine(5), 1.0)
    assert ld.observed(theirs(6), 2.0) is Transition.DEPOSED
    assert ld.leader_identity == "other" and ld.token() is None


def test_a_different_token_for_the_same_holder_ends_the_old_tenure() -> None:
    clock = ManualClock(0.0)
    ld = replica(clock)
    ld.observed(mine(5), 0.0)
    assert ld.observed(mine(6), 1.0) is Transition.DEPOSED
    assert ld.observed(mine(6), 1.0) is Transition.ELECTED and ld.token() == 6


def test_the_sole_daemon_leads_until_it_stops() -> None:
    clock = ManualClock(0.0)
    ld = replica(clock)
    assert ld.lead_for_good(mine(2)) is Transition.ELECTED
    clock.advance(10**9)
    assert ld.acting() and ld.check() is Transition.NONE and ld.token() == 2


@pytest.mark.parametrize(("interval", "deadline", "ttl"), [(1, 5, 5), (4, 3.5, 5), (0, 1, 2)])
def test_settings_must_order_interval_deadline_ttl(
    interval: float, deadline: float, ttl: float
) -> None:
    with pytest.raises(InvalidArgument, match="renew_interval_s < renew_deadline_s < lease_ttl_s"):
        LeaseSettings(ttl_s=ttl, renew_interval_s=interval, renew_deadline_s=deadline)
