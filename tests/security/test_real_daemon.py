"""The identity and rate-limit rules against the whole daemon, as ``fleetshiftd`` composes it.

``Daemon(config)`` is the object the console script runs: its own servicers, interceptors and
rate limiter, built from the config, over real mTLS on loopback. Nothing here re-creates a
check; a test fails if the daemon stops making it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.app import Daemon
from fleetshift_rpc import pki
from fleetshift_rpc.security import client_credentials
from tests.security.conftest import Certs, registration

MODEL = "llama-70b"


@pytest.fixture
async def daemon(tmp_path: Path, certs: Certs) -> AsyncIterator[Daemon]:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        tls_cert=str(certs.daemon.cert),
        tls_key=str(certs.daemon.key),
        tls_ca=str(certs.ca),
        rate_limit_per_s=1.0,
        rate_limit_burst=3,
        models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4, 8)),),
        planner=PlannerSettings(interval_s=0),
    )
    running = Daemon(config)
    await running.start()
    try:
        yield running
    finally:
        await running.stop(0.1)


def as_holder(
    daemon: Daemon, certs: Certs, pair: pki.IssuedPair, token: str = ""
) -> grpc.aio.Channel:
    creds = client_credentials(str(certs.ca), str(pair.cert), str(pair.key), token)
    return grpc.aio.secure_channel(f"127.0.0.1:{daemon.port}", creds)


async def test_a_node_cannot_heartbeat_as_another_on_the_real_daemon(
    daemon: Daemon, certs: Certs
) -> None:
    async with as_holder(daemon, certs, certs.node_a) as ch:
        agents = pb_grpc.AgentRegistryStub(ch)
        await agents.RegisterNode(registration("node-a"), timeout=10)
        await agents.Heartbeat(pb.HeartbeatRequest(node_name="node-a"), timeout=10)
    assert daemon.registry is not None
    last = daemon.registry.last_heartbeat("node-a")
    async with as_holder(daemon, certs, certs.node_b) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.AgentRegistryStub(ch).Heartbeat(
                pb.HeartbeatRequest(node_name="node-a"), timeout=10
            )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "node-a" in err.value.details() and "node-b" in err.value.details()
    assert daemon.registry.last_heartbeat("node-a") == last  # node-a's record is untouched


async def test_the_real_route_is_not_rate_limited_but_token_guessing_on_it_is(
    daemon: Daemon, certs: Certs
) -> None:
    router = pki.issue(certs.ca.parent, "router", "edge-router")
    route = ppb.RouteRequest(model=MODEL, prompt_tokens=128, expected_output_tokens=256)
    codes = []
    async with as_holder(daemon, certs, router) as ch:
        placement = ppb_grpc.PlacementStub(ch)
        for _ in range(30):  # ten times the burst, at once
            try:
                await placement.Route(route, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.append(err.code())
    # An empty fleet has no worker to route to: each call gets the router's own answer.
    assert len(set(codes)) == 1 and grpc.StatusCode.RESOURCE_EXHAUSTED not in codes
    guessed = []
    for i in range(6):  # a node certificate guessing operator tokens on Route
        async with as_holder(daemon, certs, certs.node_a, token=f"guess-{i}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ppb_grpc.PlacementStub(ch).Route(route, timeout=10)
            guessed.append(err.value.code())
    assert guessed[:3] == [grpc.StatusCode.PERMISSION_DENIED] * 3
    assert guessed[3:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    refused = daemon.metrics.rpc_refused.labels(
        method="/fleetshift.v1.Placement/Route", code="RESOURCE_EXHAUSTED"
    )
    assert refused._value.get() == 3  # and the daemon counted each refusal
