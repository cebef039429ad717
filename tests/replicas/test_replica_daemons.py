"""Two real daemons (in this process, on real gRPC ports) sharing one PostgreSQL database.

What a caller sees: a follower forwards a call that changes the fleet to the leader and serves
reads from a view it refreshes; a graceful stop hands the lease over at once; and a leader
whose renewal is blocked in the database stops acting before its lease could expire, after
which its writes are refused.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psycopg
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.config import DaemonConfig, ReplicaSettings
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.leadership import Deposed
from fleetshift_daemon.core.operations import OperationKind
from fleetshift_rpc.replicas import aio_daemon_channel

REPLICAS = ReplicaSettings(
    lease_ttl_s=3.0, renew_interval_s=0.2, renew_deadline_s=1.5, view_refresh_s=0.1
)


def config(tmp_path: Path, name: str, pg_url: str) -> DaemonConfig:
    return DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path / name),
        database_url=pg_url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=30.0,
        liveness_check_interval_s=0.1,
        replicas=REPLICAS,
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


def registration(name: str) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(
        node_name=name,
        agent_address="127.0.0.1:50052",
        inventory_source=pb.INVENTORY_SOURCE_DECLARED,
        gpus=[
            pb.Gpu(
                index=0,
                product_name="NVIDIA H100 80GB HBM3",
                memory_bytes=80 << 30,
                compute_capability="9.0",
            )
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
