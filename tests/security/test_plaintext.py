"""Plaintext is for loopback development only, and the identity hook fails closed."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.config import ConfigError
from fleetshift_daemon.api import fleet as fleet_api
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_rpc.auth import AuthInterceptor, AuthPolicy
from fleetshift_rpc.security import check_plaintext_allowed
from fleetshift_rpc.server import start_server
from tests.security.conftest import MAX_MESSAGE, registration


@pytest.mark.parametrize("listen", ["0.0.0.0:50051", "10.1.2.3:50051", "[::]:50051", "node:1"])
def test_plaintext_is_refused_off_loopback(listen: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_plaintext_allowed(listen, key="listen")
    assert err.value.field == "listen" and listen in err.value.message


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:50051", "localhost:50051"])
def test_plaintext_on_loopback_is_allowed_loudly(
    listen: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "fleetshift.security"):
        check_plaintext_allowed(listen)
    assert any("PLAINTEXT" in r.getMessage() for r in caplog.records)


async def _plaintext_server(tmp_path: Path, interceptors: list[grpc.aio.ServerInterceptor]):  # type: ignore[no-untyped-def]
    engine = make_engine(f"sqlite:///{tmp_path / 'fleetshift.db'}")
    upgrade(engine)
    registry = Registry(SqlRegistryStore(engine), time.time, 10.0)
    server = await start_server(
        "127.0.0.1:0", fleet_api.bindings(registry, 200), MAX_MESSAGE, interceptors=interceptors
    )
    return engine, registry, server


async def test_loopback_development_clients_are_trusted(tmp_path: Path) -> None:
    engine, registry, server = await _plaintext_server(tmp_path, [AuthInterceptor(AuthPolicy())])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("node-a"))
            await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("node-b"))
            node = await pb_grpc.FleetOperatorStub(ch).CordonNode(
                pb.CordonNodeRequest(node_name="node-b")
            )
        assert node.cordoned
        assert sorted(n.name for n in registry.nodes()) == ["node-a", "node-b"]
    finally:
        await server.server.stop(0)
        engine.dispose()


async def test_identity_hook_fails_closed_without_the_interceptor(tmp_path: Path) -> None:
    engine, registry, server = await _plaintext_server(tmp_path, [])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("node-a"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "interceptor" in err.value.details()
        assert registry.nodes() == []
    finally:
        await server.server.stop(0)
        engine.dispose()


async def test_plaintext_callers_are_not_trusted_when_the_policy_says_so(tmp_path: Path) -> None:
    policy = AuthPolicy(trust_plaintext_loopback=False)
    engine, registry, server = await _plaintext_server(tmp_path, [AuthInterceptor(policy)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("node-a"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert registry.nodes() == []
    finally:
        await server.server.stop(0)
        engine.dispose()
