"""An agent given several daemon replicas heartbeats each on its own, at the full timeout.

Two real gRPC registries stand in for the replicas: one answers at once, the other takes
1.5 s per heartbeat (a replica whose queue runs that long under load, as the load bench
measured). The agent's real membership loop must keep the quick replica heard at the
interval, and must let the slow one answer rather than give up after a second: a replica
that never receives a heartbeat in time declares the node lost and routes nothing to it,
although the node is healthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import grpc
import pytest
from aiorwlock import RWLock

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_agent import membership as membership_module
from fleetshift_agent.membership import Backoff, Membership
from fleetshift_rpc import heartbeat_stream
from fleetshift_rpc.heartbeat_stream import HeartbeatSender
from fleetshift_rpc.metrics import AgentMetrics

from ..test_registry_api import registration
from .fleet import serving_registry

INTERVAL_MS = 100
SLOW_ANSWER_S = 1.5
RUN_S = 3.0


class Replica(pb_grpc.AgentRegistryServicer):
    """Plays one daemon replica without HeartbeatStream (a daemon older than it: the agent
    falls back to unary Heartbeat): counts registrations, heartbeats received and answered,
    and heartbeats whose caller gave up (the handler is cancelled when the client's deadline
    passes, or when it cancels the stream)."""

    def __init__(self, answer_after_s: float) -> None:
        self.answer_after_s = answer_after_s
        self.registrations = 0
        self.received = 0
        self.answered = 0
        self.given_up = 0
        self.stream_calls = 0

    async def RegisterNode(self, request, context):  # type: ignore[no-untyped-def]
        self.registrations += 1
        return pb.RegisterNodeResponse(
            node=pb.Node(name=request.node_name),
            heartbeat_interval_ms=INTERVAL_MS,
            created=True,
        )

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        return await self.answer()

    async def answer(self) -> pb.HeartbeatResponse:
        self.received += 1
        try:
            await asyncio.sleep(self.answer_after_s)
        except asyncio.CancelledError:
            self.given_up += 1
            raise
        self.answered += 1
        return pb.HeartbeatResponse(state=pb.NODE_STATE_READY)


class StreamReplica(Replica):
    """The same with HeartbeatStream, as today's daemon serves it."""

    async def HeartbeatStream(self, requests, context):  # type: ignore[no-untyped-def]
        self.stream_calls += 1
        await context.send_initial_metadata(())
        async for _request in requests:
            yield await self.answer()


def node_membership(addresses: str, node: str, **options: Any) -> Membership:
    """The agent's real membership loop for ``node``, heartbeating every replica listed."""
    return Membership(
        addresses,
        registration=lambda: registration(node),
        heartbeat=lambda: pb.HeartbeatRequest(node_name=node),
        backoff=Backoff(0.05, 0.5),
        max_message_bytes=4 << 20,
        **options,
    )


@pytest.fixture(params=["stream", "unary"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Replica, Replica, str]]:
    kind = StreamReplica if request.param == "stream" else Replica
    quick, slow = kind(0.0), kind(SLOW_ANSWER_S)
    async with AsyncExitStack() as stack:
        ports = [await stack.enter_async_context(serving_registry(r)) for r in (quick, slow)]
        yield quick, slow, ",".join(f"127.0.0.1:{port}" for port in ports)


async def test_a_slow_replica_neither_loses_the_node_nor_holds_up_the_others(
    replicas: tuple[Replica, Replica, str],
) -> None:
    quick, slow, addresses = replicas
    membership = node_membership(addresses, "node-r")
    task = asyncio.create_task(membership.run())
    try:
        await asyncio.sleep(RUN_S)
        given_up = slow.given_up  # before the end: stopping cancels the heartbeat in flight
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # The slow replica heard heartbeats, none timed out, and the agent never registered again.
    assert slow.answered >= 1
    assert given_up == 0
    assert slow.registrations == 1
    # The quick replica was heard at about its interval all along (30 heartbeats at most in
    # 3 s); taking turns with the slow one's 1.5 s answers would have allowed it a handful.
    assert quick.answered >= 15, quick.answered
    assert quick.registrations == 1


async def test_a_worker_change_waits_for_a_report_in_flight_to_any_replica(
    replicas: tuple[Replica, Replica, str],
) -> None:
    """The order the agent promises (no report built before a start or stop is answered after
    it) holds with replicas too: the change waits for the slow replica's report in flight."""
    _quick, slow, addresses = replicas
    lock = RWLock()
    membership = node_membership(addresses, "node-o", report_lock=lock)
    task = asyncio.create_task(membership.run())
    try:
        while slow.received <= slow.answered:  # until a heartbeat to it is in flight
            await asyncio.sleep(0.01)
        answered_before = slow.answered
        async with lock.writer:  # what a worker start's or stop's last step takes
            assert slow.answered > answered_before  # the report in flight was answered first
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_agent_counts_each_replicas_heartbeats_by_outcome(
    replicas: tuple[Replica, Replica, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an operator reads from the agents' /metrics: the quick replica answered, the one
    slower than the deadline timed out, each under its own address."""
    monkeypatch.setattr(membership_module, "RPC_TIMEOUT_S", 0.5)  # below the slow one's 1.5 s
    _quick, slow, addresses = replicas
    quick_address, slow_address = addresses.split(",")
    metrics = AgentMetrics("node-m")
    membership = node_membership(addresses, "node-m", on_heartbeat=metrics.heartbeat)
    task = asyncio.create_task(membership.run())
    try:
        await asyncio.sleep(2.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    heartbeats = "fleetshift_agent_heartbeats_total"
    assert sample(heartbeats, daemon=quick_address, outcome="answered") >= 5
    assert sample(heartbeats, daemon=quick_address, outcome="timed_out") == 0
    assert sample(heartbeats, daemon=slow_address, outcome="timed_out") >= 1
    assert sample(heartbeats, daemon=slow_address, outcome="answered") == 0
    assert slow.given_up >= 1 and slow.registrations == 1  # timed out, not registered again
    round_trips = "fleetshift_agent_heartbeat_seconds_count"
    assert sample(round_trips, daemon=quick_address) == sample(
        heartbeats, daemon=quick_address, outcome="answered"
    )
    assert sample(round_trips, daemon=slow_address) == 0


async def test_an_agent_on_unary_heartbeats_takes_the_stream_once_its_daemon_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rolling upgrade: the daemon at an address is replaced by one that has HeartbeatStream
    and knows the node (it never asks the agent to register again). The agent, which fell
    back to unary Heartbeat, tries the stream again after STREAM_RETRY_S and keeps it."""
    monkeypatch.setattr(heartbeat_stream, "STREAM_RETRY_S", 0.3)
    old = Replica(0.0)
    async with serving_registry(old) as port:
        membership = node_membership(f"127.0.0.1:{port}", "node-u")
        task = asyncio.create_task(membership.run())
        while old.answered < 3:
            await asyncio.sleep(0.02)
    new = StreamReplica(0.0)
    try:
        async with serving_registry(new, port):
            for _ in range(300):
                if new.stream_calls and new.answered >= 10:
                    break
                await asyncio.sleep(0.02)
            streamed_from = new.answered
            await asyncio.sleep(1.0)  # past several retry periods: the stream is kept
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert old.stream_calls == 0  # (it has no HeartbeatStream: every heartbeat was unary)
    assert new.stream_calls == 1 and new.answered >= streamed_from + 5


@pytest.mark.parametrize("yields", range(6))
async def test_a_heartbeat_cancelled_as_its_answer_lands_ends_cancelled(yields: int) -> None:
    """A heartbeat whose caller is cancelled must end cancelled, even when its answer is in
    at that moment: an agent's stop cancels its membership loop and waits for it, and a
    cancellation swallowed there (asyncio.wait_for on Python 3.11 returns the inner result
    instead) let the loop heartbeat on for ever: a CI run hung 300 s in it. The exchange
    answers without waiting, and the cancel lands ``yields`` loop steps into the send."""
    sender = HeartbeatSender(grpc.aio.insecure_channel("127.0.0.1:1"))  # never dialled

    async def answered_at_once(request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(state=pb.NODE_STATE_READY)

    sender._exchange = answered_at_once  # type: ignore[method-assign]
    task = asyncio.create_task(sender.send(pb.HeartbeatRequest(node_name="n"), timeout=5))
    for _ in range(yields):
        await asyncio.sleep(0)
    if task.cancel():  # the send was still running: it must not finish as if uncancelled
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert task.result().state == pb.NODE_STATE_READY
