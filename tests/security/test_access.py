"""The authorization matrix over real TLS on loopback: who may call what on the daemon."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path

import grpc
import pytest

import fleetshift.v1
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_rpc.auth import METHOD_ACCESS, Access, AuthPolicy
from fleetshift_rpc.heartbeat_stream import HeartbeatSender
from tests.security.conftest import Certs, registration, secure_fleet

Code = grpc.StatusCode


async def rpc_error(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def test_node_registers_and_heartbeats_as_itself(tmp_path: Path, certs: Certs) -> None:
    async with secure_fleet(tmp_path, certs) as fleet, fleet.channel(certs.node_a) as ch:
        agents = fleet.agents(ch)
        reply = await agents.RegisterNode(registration("node-a"))
        assert reply.created and reply.node.name == "node-a"
        beat = await agents.Heartbeat(pb.HeartbeatRequest(node_name="node-a"))
        assert beat.state == pb.NODE_STATE_READY
        assert [n.name for n in fleet.registry.nodes()] == ["node-a"]


async def test_node_cannot_register_or_heartbeat_as_another(
    tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    async with secure_fleet(tmp_path, certs) as fleet:
        async with fleet.channel(certs.node_b) as ch_b:
            await fleet.agents(ch_b).RegisterNode(registration("node-b"))
        async with fleet.channel(certs.node_a) as ch:
            agents = fleet.agents(ch)
            with caplog.at_level(logging.WARNING, "fleetshift.security"):
                err = await rpc_error(agents.RegisterNode(registration("node-b")))
            assert err.code() == Code.PERMISSION_DENIED
            assert "'node-a'" in err.details() and "'node-b'" in err.details()
            assert any(getattr(r, "claimed", None) == "node-b" for r in caplog.records)
            err = await rpc_error(agents.Heartbeat(pb.HeartbeatRequest(node_name="node-b")))
            assert err.code() == Code.PERMISSION_DENIED
            assert "'node-a'" in err.details() and "'node-b'" in err.details()
        (node_b,) = fleet.registry.nodes()
        assert node_b.name == "node-b" and node_b.agent_address == "127.0.0.1:50052"


async def test_node_cannot_heartbeat_as_another_over_a_heartbeat_stream(
    tmp_path: Path, certs: Certs
) -> None:
    """The stream checks the node's identity per message, as unary Heartbeat does per call."""
    async with secure_fleet(tmp_path, certs) as fleet:
        async with fleet.channel(certs.node_b) as ch_b:
            await fleet.agents(ch_b).RegisterNode(registration("node-b"))
        async with fleet.channel(certs.node_a) as ch:
            await fleet.agents(ch).RegisterNode(registration("node-a"))
            sender = HeartbeatSender(ch)
            beat = await sender.send(pb.HeartbeatRequest(node_name="node-a"), timeout=10)
            assert beat.state == pb.NODE_STATE_READY
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sender.send(pb.HeartbeatRequest(node_name="node-b"), timeout=10)
            assert err.value.code() == Code.PERMISSION_DENIED
            assert "'node-a'" in err.value.details() and "'node-b'" in err.value.details()
            sender.close()
        assert sender.calls_opened == 1 and not sender.unary


async def test_agent_certificate_cannot_call_operator_methods(
    tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    async with secure_fleet(tmp_path, certs) as fleet, fleet.channel(certs.node_a) as ch:
        await fleet.agents(ch).RegisterNode(registration("node-a"))
        operator = fleet.operator(ch)
        with caplog.at_level(logging.WARNING, "fleetshift.auth"):
            err = await rpc_error(operator.CordonNode(pb.CordonNodeRequest(node_name="node-a")))
        assert err.code() == Code.PERMISSION_DENIED
        assert "node:node-a" in err.details() and "CordonNode" in err.details()
        refused = [r for r in caplog.records if r.getMessage().startswith("rpc refused")]
        assert refused and refused[-1].method == "/fleetshift.v1.FleetOperator/CordonNode"  # type: ignore[attr-defined]
        assert refused[-1].peer.startswith("ipv4:127.0.0.1:")  # type: ignore[attr-defined]
        err = await rpc_error(operator.ListNodes(pb.ListNodesRequest()))
        assert err.code() == Code.PERMISSION_DENIED
        assert not fleet.registry.get("node-a").cordoned


async def test_operator_may_cordon_with_a_token_or_a_certificate(
    tmp_path: Path, certs: Certs
) -> None:
    from tests.security.conftest import OPERATOR_TOKEN

    async with secure_fleet(tmp_path, certs) as fleet:
        async with fleet.channel(certs.node_a) as ch:
            await fleet.agents(ch).RegisterNode(registration("node-a"))
        async with fleet.channel(None, token=OPERATOR_TOKEN, mtls=False) as ch:
            node = await fleet.operator(ch).CordonNode(
                pb.CordonNodeRequest(node_name="node-a", reason="firmware")
            )
        assert node.cordoned and fleet.registry.get("node-a").cordoned
        async with fleet.channel(certs.operator) as ch:
            node = await fleet.operator(ch).UncordonNode(pb.UncordonNodeRequest(node_name="node-a"))
            assert not node.cordoned
            # an operator certificate is not a node certificate
            err = await rpc_error(fleet.agents(ch).RegisterNode(registration("alice")))
            assert err.code() == Code.PERMISSION_DENIED
        assert not fleet.registry.get("node-a").cordoned


async def test_missing_token_is_unauthenticated_and_wrong_token_is_denied(
    tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    async with secure_fleet(tmp_path, certs) as fleet:
        async with fleet.channel(certs.node_a) as ch:
            await fleet.agents(ch).RegisterNode(registration("node-a"))
        cordon = pb.CordonNodeRequest(node_name="node-a")
        async with fleet.channel(None, mtls=False) as ch:
            err = await rpc_error(fleet.operator(ch).CordonNode(cordon))
            assert err.code() == Code.UNAUTHENTICATED
            assert "Bearer" in err.details()
            err = await rpc_error(fleet.agents(ch).RegisterNode(registration("node-a")))
            assert err.code() == Code.UNAUTHENTICATED
        async with fleet.channel(None, token="guessed", mtls=False) as ch:
            with caplog.at_level(logging.WARNING, "fleetshift.auth"):
                err = await rpc_error(fleet.operator(ch).CordonNode(cordon))
            assert err.code() == Code.PERMISSION_DENIED
            assert "token" in err.details()
        codes = [getattr(r, "code", None) for r in caplog.records]
        assert "PERMISSION_DENIED" in codes
        assert not fleet.registry.get("node-a").cordoned


@pytest.mark.parametrize("read_only_open", [True, False])
async def test_read_only_calls_open_or_closed_by_config(
    tmp_path: Path, certs: Certs, read_only_open: bool
) -> None:
    policy = AuthPolicy(read_only_open=read_only_open)
    async with secure_fleet(tmp_path, certs, policy) as fleet:
        async with fleet.channel(certs.node_a) as ch:
            await fleet.agents(ch).RegisterNode(registration("node-a"))
        async with fleet.channel(None, mtls=False) as ch:
            operator = fleet.operator(ch)
            if read_only_open:
                nodes = (await operator.ListNodes(pb.ListNodesRequest())).nodes
                assert [n.name for n in nodes] == ["node-a"]
                node = await operator.GetNode(pb.GetNodeRequest(node_name="node-a"))
                assert node.name == "node-a"
            else:
                err = await rpc_error(operator.ListNodes(pb.ListNodesRequest()))
                assert err.code() == Code.UNAUTHENTICATED
            # mutating calls stay closed whatever the read-only setting
            err = await rpc_error(operator.CordonNode(pb.CordonNodeRequest(node_name="node-a")))
            assert err.code() == Code.UNAUTHENTICATED


async def test_health_is_public(tmp_path: Path, certs: Certs) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with secure_fleet(tmp_path, certs) as fleet, fleet.channel(None, mtls=False) as ch:
        await fleet.tls.set_serving(True)
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_client_without_certificate_cannot_reach_the_mtls_port(
    tmp_path: Path, certs: Certs
) -> None:
    async with secure_fleet(tmp_path, certs) as fleet, fleet.channel(None) as ch:
        err = await rpc_error(fleet.agents(ch).RegisterNode(registration("node-a"), timeout=5))
        assert err.code() == Code.UNAVAILABLE
        assert fleet.registry.nodes() == []


async def test_certificate_from_another_ca_is_refused(tmp_path: Path, certs: Certs) -> None:
    foreign = certs.foreign_node_a
    async with secure_fleet(tmp_path, certs) as fleet:
        creds = grpc.ssl_channel_credentials(
            certs.ca.read_bytes(), foreign.key.read_bytes(), foreign.cert.read_bytes()
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{fleet.mtls.port}", creds) as ch:
            err = await rpc_error(fleet.agents(ch).RegisterNode(registration("node-a"), timeout=5))
            assert err.code() == Code.UNAVAILABLE
        # and an agent that trusts only its own CA refuses a daemon certified by another one
        mine = certs.node_a
        creds = grpc.ssl_channel_credentials(
            certs.foreign_ca.read_bytes(), mine.key.read_bytes(), mine.cert.read_bytes()
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{fleet.mtls.port}", creds) as ch:
            err = await rpc_error(fleet.agents(ch).RegisterNode(registration("node-a"), timeout=5))
            assert err.code() == Code.UNAVAILABLE
        assert fleet.registry.nodes() == []


def test_every_rpc_in_the_protos_is_classified() -> None:
    """A new RPC must get a line in METHOD_ACCESS (an unlisted one would fall to the
    operator-write default: safe, but probably not what its author meant)."""
    policy = AuthPolicy()
    unclassified = []
    names = [m.name for m in pkgutil.iter_modules(fleetshift.v1.__path__)]
    modules = [importlib.import_module(f"fleetshift.v1.{n}") for n in names if n.endswith("_pb2")]
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {"fleet_pb2", "agent_pb2"}
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                if path not in METHOD_ACCESS and f"/{service.full_name}/*" not in METHOD_ACCESS:
                    unclassified.append(path)
    assert unclassified == []
    assert policy.access_for("/fleetshift.v1.FleetOperator/Rebalance") is Access.OPERATOR_WRITE
    assert policy.access_for("/fleetshift.v1.AgentRegistry/Heartbeat") is Access.AGENT
    assert policy.access_for("/grpc.health.v1.Health/Watch") is Access.PUBLIC
