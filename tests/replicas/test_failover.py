"""Three daemons on PostgreSQL; the leader is SIGKILLed in the middle of a move.

Real processes throughout: three ``fleetshiftd`` replicas on one fresh PostgreSQL database,
three agents with declared GPUs that list every replica, reference-engine workers, and four
sessions streaming through the move, following their session through ``LocateSession`` on a
channel that lists every replica. A failpoint holds the leader right after a phase of the
move; the test SIGKILLs it there. Afterwards:

- a follower took the lease within the lease time, and its first write (the recovered
  operation) came within the lease time plus one renewal;
- the move ended the one way the rule prescribes: before ``switched`` rolled back and, since
  the move still holds, run again by the new leader to completion; from ``switched`` on,
  completed forward;
- every session's tokens equal an uninterrupted run; one serving worker; the registry equals
  what the agents run;
- Route, called the whole time on the replica list, was never refused.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import grpc
import pytest
from sqlalchemy import func, select

from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_daemon.store.models import LeaderLeaseRow, OperationRow
from fleetshift_rpc.replicas import aio_daemon_channel
from tests.e2e.conftest import MODEL, NODES
from tests.e2e.test_moves import TOKENS, start_worker, stream_all
from tests.fleet_checks import finished, registry_matches_agents
from tests.replicas.fleet import RENEW_S, TTL_S, ReplicaFleet, replica_fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


class RouteProbe:
    """Route on the replica list every 20 ms: answers, refusals, and the longest gap."""

    def __init__(self, daemon: grpc.aio.Channel) -> None:
        self._stub = ppb_grpc.PlacementStub(daemon)
        self.served: list[float] = []
        self.refused: list[str] = []
        self.refused_at: list[float] = []

    async def run(self) -> None:
        request = ppb.RouteRequest(model=MODEL, prompt_tokens=32, expected_output_tokens=16)
        while True:
            try:
                await self._stub.Route(request, timeout=5)
                self.served.append(time.time())
            except grpc.aio.AioRpcError as err:
                self.refused.append(f"{err.code().name}: {err.details()}")
                self.refused_at.append(time.time())
            await asyncio.sleep(0.02)

    def longest_gap_around(self, t: float) -> float:
        times = [s for s in self.served if s > t - 5]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def first_write_after(fleet: ReplicaFleet, t: float) -> tuple[float | None, int]:
    """When the new leader first wrote an operation, and the lease's token now."""
    with fleet.engine().connect() as conn:
        updated = conn.execute(select(func.max(OperationRow.updated_at))).scalar_one()
        token = conn.execute(select(LeaderLeaseRow.token)).scalar_one()
    ts = updated.timestamp() if updated is not None else None
    return (ts if ts is not None and ts > t else None), int(token)


@pytest.mark.parametrize("phase", ["source_paused", "switched"])
async def test_leader_killed_mid_move(
    tmp_path: Path, model_dir: Path, pg_url: str, reference_tokens, phase: str
) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "hold"
    fleet = replica_fleet(tmp_path / "fleet", model_dir, pg_url, nodes=NODES)
    # Only the first replica carries the failpoint, and it is made leader by starting first.
    fleet.replica_env[0] = {"FLEETSHIFT_FAILPOINTS": f"after:{phase}=hold:{marker}"}
    try:
        fleet.start_replica(0, 120)
        assert fleet.leader() == 0
        fleet.start_replica(1, 120)
        fleet.start_replica(2, 120)
        for spec in NODES:
            fleet.start_agent(spec, 120)
        fleet.wait_ready({n.name for n in NODES}, 120)
        async with aio_daemon_channel(fleet.daemon_address) as daemon:
            ops = pb_grpc.OperationsStub(daemon)
            worker = await start_worker(ops, "h100-a")  # forwarded by a follower, or not
            probe = RouteProbe(daemon)
            routes = asyncio.create_task(probe.run())
            started = asyncio.Event()
            streams = asyncio.create_task(stream_all(daemon, worker.endpoint, started))
            await asyncio.wait_for(started.wait(), 90)
            op = await ops.MoveWorker(
                pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node="h100-b"), timeout=30
            )
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert time.monotonic() < deadline, "failpoint not reached"
                await asyncio.sleep(0.05)
            _, old_token = first_write_after(fleet, 0)
            killed_at = time.time()
            fleet.kill_replica(0)
            new_leader = await asyncio.to_thread(fleet.leader, 30)
            elected_after = time.time() - killed_at
            first_write: float | None = None
            while first_write is None:
                first_write, token = first_write_after(fleet, killed_at)
                assert time.time() - killed_at < 60, "the new leader never acted"
                await asyncio.sleep(0.02)
            final = await finished(ops, op.id)
            tokens = await asyncio.wait_for(streams, 240)
            routes.cancel()
            serving = await registry_matches_agents(daemon)

        print(
            f"\nfailover at {phase}: lease taken {elected_after:.2f}s after SIGKILL, first "
            f"write {first_write - killed_at:.2f}s; Route longest gap "
            f"{probe.longest_gap_around(killed_at) * 1000:.0f} ms, refused {len(probe.refused)}"
        )
        assert new_leader in (1, 2) and token == old_token + 1
        assert first_write - killed_at < TTL_S + RENEW_S + 1.0
        assert tokens == reference_tokens[TOKENS]
        assert len(serving) == 1
        first = final.steps[0]
        assert final.state == pb.OPERATION_STATE_SUCCEEDED, final
        if phase == "switched":
            assert first.state == pb.STEP_STATE_DONE and len(final.steps) == 1
        else:
            assert first.state == pb.STEP_STATE_ROLLED_BACK and "leader changed" in first.error
            assert [s.state for s in final.steps[1:]] == [pb.STEP_STATE_DONE]
            assert serving == {final.steps[1].new_worker_id}
        # Every call on the replica list answered, from the first one (made as soon as the
        # leader acknowledged the worker's start, before a follower's periodic refresh could
        # have seen it) through the takeover.
        when = [round(t - killed_at, 3) for t in probe.refused_at]
        assert probe.refused == [], f"Route refused at {when} s from the kill: {probe.refused}"
    finally:
        marker.unlink(missing_ok=True)
        fleet.stop()
