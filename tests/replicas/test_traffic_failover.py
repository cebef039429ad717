"""Three real ``fleetshiftd`` processes on PostgreSQL; the leader answers Route calls and is
SIGKILLed. The traffic mix the new leader plans on, as GetTrafficMix shows it on every live
replica and on the replica list a client is given, counts every call the old leader answered
(once its publication round has passed), and every other call, each once.

Before fs-17f the leader did not publish the calls it answered itself: the new leader's mix
lacked them for the whole window (5 min), so it planned on a fraction of the traffic.

The fleet is what the daemons find in the database when they start (one node, one serving
worker, as a restarted fleet would), so no agent or engine process is needed: Route only picks
a worker, it never calls it.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_rpc.replicas import sync_daemon_channel
from tests.replicas.fleet import SEEDED_MODEL as MODEL
from tests.replicas.fleet import seeded_fleet

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

LEADER_PROMPT, FOLLOWER_PROMPT = 1000, 100  # tells whose calls a mix counts


def route(address: str, prompt: int, calls: int) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = ppb_grpc.PlacementStub(ch)
        for _ in range(calls):
            request = ppb.RouteRequest(model=MODEL, prompt_tokens=prompt, expected_output_tokens=8)
            assert stub.Route(request, timeout=10).worker_id == "w1"


def mix(address: str) -> tuple[int, float]:
    """What GetTrafficMix shows for MODEL: requests in the window and their mean prompt."""
    with sync_daemon_channel(address) as ch:
        reply = ppb_grpc.PlanningStub(ch).GetTrafficMix(
            ppb.GetTrafficMixRequest(model=MODEL), timeout=10
        )
    [m] = reply.models
    return m.requests_in_window, m.prompt_tokens.mean


def until_shows(address: str, want: int, timeout_s: float) -> tuple[int, float]:
    deadline = time.monotonic() + timeout_s
    seen = mix(address)
    while seen[0] != want and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = mix(address)
    return seen


def test_the_new_leader_plans_on_the_calls_the_killed_leader_answered(
    tmp_path: Path, pg_url: str
) -> None:
    fleet = seeded_fleet(tmp_path / "fleet", pg_url)
    try:
        fleet.start_replica(0, 120)
        assert fleet.leader() == 0
        fleet.start_replica(1, 120)
        fleet.start_replica(2, 120)
        leader, followers = 0, (1, 2)
        route(fleet.replica_address(leader), LEADER_PROMPT, 12)
        route(fleet.replica_address(1), FOLLOWER_PROMPT, 7)
        route(fleet.replica_address(2), FOLLOWER_PROMPT, 5)
        total = 12 + 7 + 5
        mean = (12 * LEADER_PROMPT + 12 * FOLLOWER_PROMPT) / total
        assert until_shows(fleet.replica_address(leader), total, 15) == (total, mean)
        # the publication delay (a round a second): wait until a follower shows them too,
        # or as long as three rounds would have taken, then kill the leader where it stands
        until_shows(fleet.replica_address(1), total, 3.0)
        fleet.kill_replica(leader)
        new = fleet.leader(30)
        assert new in followers
        # the new leader first (what it plans on), then the other survivor
        for index in sorted(followers, key=lambda i: i != new):
            assert until_shows(fleet.replica_address(index), total, 10) == (total, mean), index
        time.sleep(2.5)  # more rounds take nothing in twice
        for address in [fleet.replica_address(i) for i in followers] + [fleet.daemon_address]:
            assert mix(address) == (total, mean), address
    finally:
        fleet.stop(workers=False)
