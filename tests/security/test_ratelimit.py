"""Rate limiting per caller over real TLS, and a table that stays bounded."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_common.config import ConfigError
from fleetshift_rpc.auth import RETRY_AFTER_KEY
from fleetshift_rpc.heartbeat_stream import HeartbeatSender
from fleetshift_rpc.ratelimit import RateLimit, RateLimiter
from fleetshift_rpc.security import OperatorTokens, hash_token
from tests.security.conftest import Certs, registration, secure_fleet


def retry_after_ms(err: grpc.aio.AioRpcError) -> int:
    trailing = dict(err.trailing_metadata() or ())
    return int(trailing[RETRY_AFTER_KEY])


async def test_burst_is_refused_with_a_retry_hint_then_served_again(
    tmp_path: Path, certs: Certs
) -> None:
    limit = RateLimit(rate_per_s=4.0, burst=5, max_clients=100)
    async with (
        secure_fleet(tmp_path, certs, limit=limit) as fleet,
        fleet.channel(certs.node_a) as ch_a,
        fleet.channel(certs.node_b) as ch_b,
    ):
        agents = fleet.agents(ch_a)
        await agents.RegisterNode(registration("node-a"))
        beat = pb.HeartbeatRequest(node_name="node-a")
        outcomes = []
        for _ in range(10):
            try:
                await agents.Heartbeat(beat)
                outcomes.append("ok")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                outcomes.append(err)
        refused = [o for o in outcomes if o != "ok"]
        # the burst of 5 went through (the registration took one), the rest did not
        assert outcomes[:4] == ["ok"] * 4 and len(refused) >= 3
        err = refused[-1]
        assert isinstance(err, grpc.aio.AioRpcError)
        hint = retry_after_ms(err)
        assert 1 <= hint <= 250  # one token at 4/s is at most 250 ms away
        assert f"retry in {hint} ms" in err.details()
        # another node is not affected by node-a's burst
        await fleet.agents(ch_b).RegisterNode(registration("node-b"))
        await asyncio.sleep(hint / 1000 + 0.02)
        reply = await agents.Heartbeat(beat)
        assert reply.state == pb.NODE_STATE_READY


async def test_a_heartbeat_stream_counts_each_message_against_the_bucket(
    tmp_path: Path, certs: Certs
) -> None:
    """One HeartbeatStream call carries all of a node's heartbeats: were the bucket charged per
    call only, a runaway agent could flood the daemon on one stream."""
    limit = RateLimit(rate_per_s=4.0, burst=5, max_clients=100)
    async with (
        secure_fleet(tmp_path, certs, limit=limit) as fleet,
        fleet.channel(certs.node_a) as ch,
    ):
        await fleet.agents(ch).RegisterNode(registration("node-a"))
        sender = HeartbeatSender(ch)
        beat = pb.HeartbeatRequest(node_name="node-a")
        outcomes: list[object] = []
        for _ in range(10):
            try:
                await sender.send(beat, timeout=10)
                outcomes.append("ok")
            except grpc.aio.AioRpcError as err:
                outcomes.append(err)
        refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
        # the registration took one token and the call's admission the first message's
        assert outcomes[:4] == ["ok"] * 4 and refused
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert "rate limit for" in refused[0].details()
        await asyncio.sleep(0.6)  # two tokens back at 4/s: a new call and its first message
        reply = await sender.send(beat, timeout=10)
        assert reply.state == pb.NODE_STATE_READY
        sender.close()
        assert not sender.unary


async def test_table_stays_bounded_under_many_distinct_clients(
    tmp_path: Path, certs: Certs
) -> None:
    tokens = {f"op{i}": f"token-{i}" for i in range(24)}
    store = OperatorTokens.parse([f"{name} {hash_token(t)}" for name, t in tokens.items()])
    limit = RateLimit(rate_per_s=1.0, burst=1, max_clients=8)
    async with secure_fleet(tmp_path, certs, limit=limit, tokens=store) as fleet:
        assert fleet.limiter is not None
        for token in tokens.values():
            async with fleet.channel(None, token=token, mtls=False) as ch:
                await fleet.operator(ch).ListNodes(pb.ListNodesRequest())
            assert len(fleet.limiter) <= 8
        assert len(fleet.limiter) == 8 and fleet.limiter.evictions == 16
        # op0 was evicted long ago: it starts again with a full bucket instead of waiting
        async with fleet.channel(None, token=tokens["op0"], mtls=False) as ch:
            operator = fleet.operator(ch)
            await operator.ListNodes(pb.ListNodesRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await operator.ListNodes(pb.ListNodesRequest())
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bucket_refills_at_its_rate() -> None:
    now = [100.0]
    limiter = RateLimiter(RateLimit(rate_per_s=4.0, burst=2, max_clients=10), lambda: now[0])
    assert limiter.check("a").allowed and limiter.check("a").allowed
    refused = limiter.check("a")
    assert not refused.allowed and refused.retry_after_ms == 250
    now[0] += 0.2
    assert not limiter.check("a").allowed  # 0.8 of a token
    now[0] += 0.05
    assert limiter.check("a").allowed
    now[0] += 60  # idle for a minute: back to the burst, never above it
    assert [limiter.check("a").allowed for _ in range(3)] == [True, True, False]


def test_memory_stays_flat_under_a_flood_of_distinct_keys() -> None:
    limiter = RateLimiter(RateLimit(max_clients=1000), lambda: 0.0)
    tracemalloc.start()
    for i in range(10_000):
        limiter.check(f"flood-{i}")
    full, _ = tracemalloc.get_traced_memory()
    for i in range(10_000, 50_000):
        limiter.check(f"flood-{i}")
    later, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(limiter) == 1000 and limiter.evictions == 49_000
    # 40,000 more clients replaced buckets instead of adding ~10 MB of new ones
    assert later - full < 16 * 1024, (full, later)


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("rate_per_s", "rate_limit_per_s"),
        ("burst", "rate_limit_burst"),
        ("max_clients", "rate_limit_max_clients"),
    ],
)
def test_limits_must_be_positive(field: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        RateLimit(**{field: 0})  # type: ignore[arg-type]
    assert err.value.field == key


# The router's exemption (and a token guesser's limit on Route) is tested on the real
# Placement/Route of a real daemon: tests/security/test_real_daemon.py.
