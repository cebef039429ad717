"""Two real daemons (in this process, on real gRPC ports) sharing one PostgreSQL database.

What a caller sees: a follower forwards a call that changes the fleet to the leader and serves
reads from a view it refreshes; a graceful stop hands the lease over at once; and a leader
whose renewal is blocked in the database stops acting before its lease could expire, after
which its writes are refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_common.config import DaemonConfig, ModelConfig, ReplicaSettings
from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.operations import OperationKind
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec
from fleetshift_rpc.replicas import aio_daemon_channel
from fleetshift_rpc.route_stream import RouteClient

REPLICAS = ReplicaSettings(
    lease_ttl_s=3.0, renew_interval_s=0.2, renew_deadline_s=1.5, view_refresh_s=0.1
)


def config(tmp_path: Path, name: str, pg_url: str, **kw: Any) -> DaemonConfig:
    return DaemonConfig(
        **{
            "listen": "127.0.0.1:0",
            "state_dir": str(tmp_path / name),
            "database_url": pg_url,
            "heartbeat_interval_s": 0.2,
            "node_lost_after_s": 30.0,
            "liveness_check_interval_s": 0.1,
            "replicas": REPLICAS,
            **kw,
        }
    )


async def until(check, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@pytest.fixture
async def pair(tmp_path: Path, pg_url: str) -> AsyncIterator[tuple[Daemon, Daemon]]:
    leader = Daemon(config(tmp_path, "a", pg_url))
    await leader.start()
    await until(lambda: leader.leadership is not None and leader.leadership.acting())
    follower = Daemon(config(tmp_path, "b", pg_url))
    await follower.start()
    await until(lambda: bool(follower.leadership and follower.leadership.leader_address))
    try:
        yield leader, follower
    finally:
        for daemon in (follower, leader):
            if daemon.engine is not None and daemon.server is not None:
                await daemon.stop(grace_s=0.1)


def registration(name: str, gpus: int = 1) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(
        node_name=name,
        agent_address="127.0.0.1:50052",
        inventory_source=pb.INVENTORY_SOURCE_DECLARED,
        gpus=[
            pb.Gpu(
                index=i,
                product_name="NVIDIA H100 80GB HBM3",
                memory_bytes=80 << 30,
                compute_capability="9.0",
            )
            for i in range(gpus)
        ],
    )


async def test_follower_forwards_writes_and_serves_reads(pair: tuple[Daemon, Daemon]) -> None:
    leader, follower = pair
    assert follower.leadership is not None and not follower.leadership.acting()
    both = f"127.0.0.1:{follower.port},127.0.0.1:{leader.port}"
    for daemon in pair:  # an agent registers with every replica it is given
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("n1"), timeout=5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{follower.port}") as ch:
        cordoned = await pb_grpc.FleetOperatorStub(ch).CordonNode(
            pb.CordonNodeRequest(node_name="n1", reason="maintenance"), timeout=10
        )
    assert cordoned.cordoned and cordoned.cordon_reason == "maintenance"
    assert follower.gate is not None and follower.gate.forwarded == 1
    assert leader.registry is not None and leader.registry.get("n1").cordoned  # it ran there
    follower_registry = follower.registry
    assert follower_registry is not None
    await until(lambda: follower_registry.get("n1").cordoned)  # its view caught up
    async with aio_daemon_channel(both) as ch:  # a client given both replicas
        nodes = await pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5)
    assert [n.name for n in nodes.nodes] == ["n1"] and nodes.nodes[0].cordoned
    async with grpc.aio.insecure_channel(f"127.0.0.1:{follower.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.FleetOperatorStub(ch).CordonNode(
                pb.CordonNodeRequest(node_name="nope"), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # the leader's answer, relayed


async def test_a_graceful_stop_hands_the_lease_over_without_waiting_for_the_ttl(
    pair: tuple[Daemon, Daemon],
) -> None:
    leader, follower = pair
    stopped_at = time.monotonic()
    await leader.stop(grace_s=0.1)
    leader.server = None  # stopped: the fixture leaves it
    assert follower.leadership is not None
    await until(follower.leadership.acting, timeout_s=REPLICAS.lease_ttl_s)
    took = time.monotonic() - stopped_at
    assert took < REPLICAS.lease_ttl_s, took
    assert follower.leadership.leader_address == f"127.0.0.1:{follower.port}"


async def test_a_leader_that_cannot_renew_stops_before_its_lease_expires(
    pair: tuple[Daemon, Daemon], pg_url: str
) -> None:
    """A transaction holding the lease row blocks every renewal (as an unreachable database
    would); the leader must stop acting before renewal + TTL, and not write afterwards."""
    leader, follower = pair
    assert leader.leadership is not None and leader.replica_loop is not None
    assert leader.operations is not None
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as blocker:
        blocker.execute("SELECT 1 FROM leader_lease WHERE id = 1 FOR UPDATE")
        blocked_at = time.monotonic()  # no renewal can start before this and succeed
        await until(lambda: not leader.leadership.acting(), timeout_s=REPLICAS.lease_ttl_s)
        stopped = time.monotonic()
        assert stopped - blocked_at < REPLICAS.lease_ttl_s
        with pytest.raises(Deposed, match="does not lead"):
            await asyncio.to_thread(
                leader.operations.create, OperationKind.DRAIN, "test", "after deposition", ()
            )
        blocker.rollback()
    assert follower.leadership is not None
    await until(
        lambda: follower.leadership.acting() or leader.leadership.acting(),
        timeout_s=REPLICAS.lease_ttl_s + 2,
    )
    assert leader.replica_loop.times.deposed_at is not None


async def test_a_leader_whose_event_loop_is_blocked_past_the_renew_deadline_keeps_its_lease(
    tmp_path: Path, pg_url: str
) -> None:
    """Route can saturate the event loop; the lease must not depend on it. The loop is blocked
    (a synchronous sleep, as a saturated loop is) for longer than the renew deadline but
    shorter than the TTL: the leader still leads afterwards, under the same token, never
    deposed, and it could act throughout (sampled from another thread while the loop slept)."""
    leader = Daemon(config(tmp_path, "a", pg_url))
    await leader.start()
    try:
        ld, loop_ = leader.leadership, leader.replica_loop
        assert ld is not None and loop_ is not None
        await until(ld.acting)
        token = ld.require_token()
        samples: list[int | None] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                samples.append(ld.token())

        sampler = threading.Thread(target=sample)
        sampler.start()
        blocked_s = (REPLICAS.renew_deadline_s + REPLICAS.lease_ttl_s) / 2  # 2.25 s
        time.sleep(blocked_s)  # the point: this event loop does nothing meanwhile
        done.set()
        sampler.join()
        await asyncio.sleep(2 * REPLICAS.renew_interval_s)  # any pending transition lands
        assert ld.acting() and ld.token() == token
        assert loop_.times.deposed_at is None and loop_.times.elections == 1
        assert len(samples) >= 30 and set(samples) == {token}, samples
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as db:
            row = db.execute("SELECT token, expires_at > now() FROM leader_lease").fetchone()
        assert row == (token, True)
    finally:
        await leader.stop(grace_s=0.1)


async def test_the_cli_given_every_replica_changes_the_fleet_and_reads_it(
    pair: tuple[Daemon, Daemon],
) -> None:
    """``fleetshift --daemon a,b``: a cordon reaches the leader whichever replica it hits."""
    leader, follower = pair
    for daemon in pair:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("n2"), timeout=5)
    both = f"127.0.0.1:{follower.port},127.0.0.1:{leader.port}"
    cli = [sys.executable, "-m", "fleetshift_daemon.cli.main", "--daemon", both]
    for command in (["cordon", "n2", "--reason", "disk"], ["nodes"]):
        done = await asyncio.to_thread(
            subprocess.run, [*cli, *command], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert "n2" in done.stdout and "cordoned" in done.stdout
    assert leader.registry is not None and leader.registry.get("n2").cordon_reason == "disk"


MODEL = ModelConfig(name="m70", preset="llama2-70b", tp_options=(4,))


@contextlib.asynccontextmanager
async def serving_pair(
    tmp_path: Path, pg_url: str, replicas: ReplicaSettings
) -> AsyncIterator[tuple[Daemon, Daemon]]:
    """A leader and a follower serving MODEL, node n1 (4 GPUs) registered with both."""
    leader = Daemon(config(tmp_path, "a", pg_url, models=(MODEL,), replicas=replicas))
    follower = Daemon(config(tmp_path, "b", pg_url, models=(MODEL,), replicas=replicas))
    try:
        await leader.start()
        await until(lambda: leader.leadership is not None and leader.leadership.acting())
        await follower.start()
        await until(lambda: bool(follower.leadership and follower.leadership.leader_address))
        for daemon in (leader, follower):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
                await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("n1", 4), timeout=5)
        yield leader, follower
    finally:
        for daemon in (follower, leader):
            if daemon.engine is not None and daemon.server is not None:
                await daemon.stop(grace_s=0.1)


async def add_worker(leader: Daemon) -> None:
    """What the leader writes when a worker has started (StartWorker's last write)."""
    assert leader.workers is not None
    await asyncio.to_thread(
        leader.workers.add,
        WorkerRecord(
            "w1", "n1", WorkerSpec("m70", Role.MIXED, tp=4), (0, 1, 2, 3), "127.0.0.1:9",
            WorkerState.SERVING, time.time(),
        ),
    )  # fmt: skip


async def test_a_follower_routes_to_a_worker_the_leader_has_just_written(
    tmp_path: Path, pg_url: str
) -> None:
    """The failover test's refusals: a caller whose StartWorker the leader has acknowledged
    routes at once, and the follower it reaches has not refreshed yet. It must re-read the
    database rather than answer "served by no worker". Its periodic refresh is set far off
    here, so only that re-read can find the worker."""
    slow = dataclasses.replace(REPLICAS, view_refresh_s=600.0)
    async with serving_pair(tmp_path, pg_url, slow) as (leader, follower):
        assert follower.replica_loop is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{follower.port}") as ch:
            route = ppb_grpc.PlacementStub(ch).Route
            reads = follower.replica_loop.reads
            for name, reread in (("m70", 1), ("nobody-serves-this", 0)):
                with pytest.raises(grpc.aio.AioRpcError) as none:  # no worker: NOT_FOUND is right
                    await route(ppb.RouteRequest(model=name, prompt_tokens=8), timeout=5)
                assert none.value.code() == grpc.StatusCode.NOT_FOUND
                # a served model is re-read once; a model nobody configured costs no database work
                assert follower.replica_loop.reads == reads + reread
                reads += reread
            # RouteStream answers without awaiting, except for this re-read: the same refusal
            stream = RouteClient(ch)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stream.route(ppb.RouteRequest(model="m70", prompt_tokens=8), timeout=5)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert follower.replica_loop.reads == reads + 1
            reads += 1
            await add_worker(leader)
            routed = await route(ppb.RouteRequest(model="m70", prompt_tokens=8), timeout=5)
            streamed = await stream.route(ppb.RouteRequest(model="m70", prompt_tokens=8))
            await stream.close()
        assert routed.worker_id == "w1" and routed.endpoint == "127.0.0.1:9"
        assert streamed.worker_id == "w1"
        assert follower.replica_loop.reads == reads + 1


def requests_seen(daemon: Daemon) -> int:
    assert daemon.placement is not None
    return daemon.placement.traffic.arrivals("m70")[0].size


async def test_the_leader_plans_on_the_arrivals_every_replica_answered(
    tmp_path: Path, pg_url: str
) -> None:
    """Route calls answered by a follower reach the leader's traffic window (the planner's
    input), at the times they arrived, and the leader's reach the follower's (which a new
    leader would plan on); each window counts each call once."""
    async with serving_pair(tmp_path, pg_url, REPLICAS) as (leader, follower):
        await add_worker(leader)
        assert follower.workers is not None and leader.placement is not None
        await until(lambda: follower.workers.find("w1") is not None)
        began = time.time()
        for daemon, calls in ((follower, 30), (leader, 10)):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
                for _ in range(calls):
                    request = ppb.RouteRequest(model="m70", prompt_tokens=100)
                    await ppb_grpc.PlacementStub(ch).Route(request, timeout=5)
        ended = time.time()
        await until(lambda: requests_seen(leader) == requests_seen(follower) == 40, 15)
        await asyncio.sleep(2 * 1.0)  # two more rounds: nothing is taken in twice
        assert requests_seen(leader) == 40 and requests_seen(follower) == 40
        for daemon in (leader, follower):
            assert daemon.placement is not None
            times = daemon.placement.traffic.arrivals("m70")[0]
            assert list(times) == sorted(times)  # merged in time order
            assert began - 0.5 < times.min() and times.max() < ended + 0.5  # at their own times
            stats = daemon.placement.traffic.stats("m70")
            assert stats.requests == 40 and stats.prompt.mean == 100


async def test_a_leader_stopped_gracefully_leaves_its_last_calls_to_the_next(
    tmp_path: Path, pg_url: str
) -> None:
    """Route calls a leader answered just before a graceful stop (its periodic publication
    set far off here, so only the stop can publish them) are in the window of the replica
    that takes over, once."""
    async with serving_pair(tmp_path, pg_url, REPLICAS) as (leader, follower):
        await add_worker(leader)
        assert follower.workers is not None and leader.traffic_share is not None
        await until(lambda: follower.workers.find("w1") is not None)
        leader.traffic_share.interval_s = 600.0
        await asyncio.sleep(1.5)  # the round under way ends; the next is ten minutes off
        async with grpc.aio.insecure_channel(f"127.0.0.1:{leader.port}") as ch:
            for _ in range(10):
                request = ppb.RouteRequest(model="m70", prompt_tokens=100)
                await ppb_grpc.PlacementStub(ch).Route(request, timeout=5)
        await leader.stop(grace_s=0.1)
        leader.server = None  # stopped: the fixture leaves it
        await until(lambda: bool(follower.leadership and follower.leadership.acting()))
        await until(lambda: requests_seen(follower) == 10, timeout_s=10)
        await asyncio.sleep(2 * 1.0)  # more rounds: nothing is taken in twice
        assert requests_seen(follower) == 10


async def test_a_follower_rereads_only_the_tables_the_leader_wrote(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operation's every step rewrites its row, several times a move: a follower that
    re-read 1,000 nodes and their GPUs for each of them spent 0.64 s of CPU a time
    (bench/follower_reads.py), beside the Route calls it serves. Only the view whose tables
    changed is re-read."""
    mark_only = dataclasses.replace(REPLICAS, view_full_read_s=1e9)  # only the mark decides
    async with serving_pair(tmp_path, pg_url, mark_only) as (leader, follower):
        assert follower.replica_loop is not None and leader.operations is not None
        assert follower.registry and follower.workers and follower.operations
        settled = follower.replica_loop.reads + 2  # a read in flight has ended by then
        await until(
            lambda: follower.replica_loop is not None and follower.replica_loop.reads >= settled
        )
        reads: collections.Counter[str] = collections.Counter()
        for name in ("registry", "workers", "operations"):
            view = getattr(follower, name)
            monkeypatch.setattr(view, "refresh", counting(reads, name, view.refresh))
        op, _ = await asyncio.to_thread(
            leader.operations.create, OperationKind.DRAIN, "test", "only operations", ()
        )
        await until(lambda: any(o.id == op.id for o in follower.operations.list()))  # type: ignore[union-attr]
        assert reads["operations"] >= 1
        assert reads["registry"] == reads["workers"] == 0
        await add_worker(leader)
        await until(lambda: follower.workers.find("w1") is not None)  # type: ignore[union-attr]
        assert reads["registry"] == 0


async def test_a_follower_reads_every_view_at_the_full_read_interval_whatever_the_mark(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark decides what a follower re-reads; a full read every ``view_full_read_s`` is
    the defence in depth (and what brings a follower the heartbeat times of an agent that
    beats only the leader): with nothing written, each view is still read that often."""
    every_second = dataclasses.replace(REPLICAS, view_full_read_s=1.0)
    async with serving_pair(tmp_path, pg_url, every_second) as (_leader, follower):
        loop = follower.replica_loop
        assert loop is not None
        settled = loop.reads + 2  # the registration's re-read has ended by then
        await until(lambda: loop.reads >= settled)
        reads: collections.Counter[str] = collections.Counter()
        for name in ("registry", "workers", "operations"):
            view = getattr(follower, name)
            monkeypatch.setattr(view, "refresh", counting(reads, name, view.refresh))
        start = time.monotonic()
        await until(lambda: loop.reads >= settled + 30)  # >= 3 s of 0.1 s refreshes, no writes
        seconds = time.monotonic() - start
        for name in ("registry", "workers", "operations"):
            assert seconds - 1.5 <= reads[name] <= seconds + 1, (name, reads, seconds)


def counting(reads: collections.Counter[str], name: str, refresh: Any) -> Any:
    def counted() -> Any:
        reads[name] += 1
        return refresh()

    return counted
