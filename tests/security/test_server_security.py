"""``server_security``: the one call a composition root makes, from config keys to ports."""

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
from fleetshift_rpc import pki
from fleetshift_rpc.auth import server_security
from fleetshift_rpc.ratelimit import RateLimit
from fleetshift_rpc.security import PrincipalKind, TlsFiles, client_credentials, parse_callers
from fleetshift_rpc.server import channel, start_server
from tests.security.conftest import Certs, registration


def test_plaintext_off_loopback_and_tokens_without_tls_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        server_security(listen="0.0.0.0:50051")
    assert err.value.field == "listen"
    with pytest.raises(ConfigError) as err:
        server_security(listen="127.0.0.1:50051", operator_listen="127.0.0.1:50053")
    assert err.value.field == "operator_listen"


def test_partial_tls_keys_are_refused_by_name(certs: Certs) -> None:
    with pytest.raises(ConfigError) as err:
        server_security(listen="0.0.0.0:0", tls_cert=str(certs.node_a.cert))
    assert err.value.field == "tls_key"


def test_an_agent_refuses_a_certificate_for_another_node(certs: Certs) -> None:
    keys = {"tls_cert": str(certs.node_a.cert), "tls_key": str(certs.node_a.key)}
    with pytest.raises(ConfigError) as err:
        server_security(
            listen="0.0.0.0:0",
            tls_ca=str(certs.ca),
            expect=(PrincipalKind.NODE, "node-b"),
            **keys,
        )
    assert err.value.field == "tls_cert" and "node:node-a" in err.value.message
    ok = server_security(
        listen="0.0.0.0:0", tls_ca=str(certs.ca), expect=(PrincipalKind.NODE, "node-a"), **keys
    )
    assert ok.credentials is not None and ok.operator_credentials is None


async def test_a_daemon_built_from_config_serves_both_ports(tmp_path: Path, certs: Certs) -> None:
    tokens = tmp_path / "operator-tokens"
    token = pki.new_token(tokens, "alice")
    refused: list[str] = []
    security = server_security(
        listen="127.0.0.1:0",
        tls_cert=str(certs.daemon.cert),
        tls_key=str(certs.daemon.key),
        tls_ca=str(certs.ca),
        operator_listen="127.0.0.1:0",
        operator_tokens_file=str(tokens),
        rate_limit=RateLimit(rate_per_s=100, burst=100),
        on_refused=lambda method, code: refused.append(code.name),
    )
    assert security.tls is not None and security.operator_credentials is not None
    engine = make_engine(f"sqlite:///{tmp_path / 'fleetshift.db'}")
    upgrade(engine)
    registry = Registry(SqlRegistryStore(engine), time.time, 10.0)
    bindings = fleet_api.bindings(registry, 200)
    main = await start_server(
        "127.0.0.1:0", bindings, 1 << 20, security.credentials, security.interceptors
    )
    ops = await start_server(
        "127.0.0.1:0", bindings, 1 << 20, security.operator_credentials, security.interceptors
    )
    try:
        # an agent dials with the fleet's channel() and its own TlsFiles
        node = client_credentials(str(certs.ca), str(certs.node_a.cert), str(certs.node_a.key))
        async with channel(f"127.0.0.1:{main.port}", 1 << 20, node) as ch:
            await pb_grpc.AgentRegistryStub(ch).RegisterNode(registration("node-a"))
        # the daemon's own TlsFiles dial out as the daemon (operator-read is open to it)
        async with channel(
            f"127.0.0.1:{main.port}", 1 << 20, security.tls.channel_credentials()
        ) as ch:
            nodes = await pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest())
            assert [n.name for n in nodes.nodes] == ["node-a"]
        async with channel(
            f"127.0.0.1:{ops.port}", 1 << 20, client_credentials(str(certs.ca), token=token)
        ) as ch:
            node_pb = await pb_grpc.FleetOperatorStub(ch).CordonNode(
                pb.CordonNodeRequest(node_name="node-a")
            )
            assert node_pb.cordoned
        async with channel(
            f"127.0.0.1:{ops.port}", 1 << 20, client_credentials(str(certs.ca))
        ) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.FleetOperatorStub(ch).UncordonNode(
                    pb.UncordonNodeRequest(node_name="node-a")
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused == ["UNAUTHENTICATED"]
        assert registry.get("node-a").cordoned
    finally:
        await main.server.stop(0)
        await ops.server.stop(0)
        engine.dispose()


def test_plaintext_loopback_is_allowed_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "fleetshift.security"):
        security = server_security(listen="127.0.0.1:50051")
    assert security.credentials is None and security.tls is None
    assert len(security.interceptors) == 1
    assert any("PLAINTEXT" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "pattern", ["router", "router:", "robot:*", "router:edge/1", ":alice", "anonymous:*"]
)
def test_session_caller_patterns_name_the_key(pattern: str) -> None:
    """An operator's typo in worker_session_callers stops the agent at start, naming the key
    and the pattern, instead of quietly letting nobody (or everybody) open sessions."""
    with pytest.raises(ConfigError) as err:
        parse_callers(["router:*", pattern])
    assert err.value.field == "worker_session_callers"
    assert repr(pattern) in err.value.message


def test_session_caller_patterns() -> None:
    assert parse_callers(["router:*", "operator:alice", "router:*"]) == {
        (PrincipalKind.ROUTER, "*"),
        (PrincipalKind.OPERATOR, "alice"),
    }


def test_worker_host_must_be_named_by_the_node_certificate(tmp_path: Path) -> None:
    """The daemon and the router verify a worker's certificate against the address they
    dial; an agent whose workers would serve elsewhere is refused at start, naming the key."""
    pki.init_ca(tmp_path)
    pair = pki.issue(
        tmp_path, "node", "n1", san_ips=["198.18.0.11"], san_dns=["n1.fleet.lan", "*.gpu.lan"]
    )
    tls = TlsFiles(str(pair.cert), str(pair.key), str(tmp_path / pki.CA_CERT))
    for named in ("198.18.0.11", "n1.fleet.lan", "N1.Fleet.Lan", "h100-7.gpu.lan"):
        tls.check_host(named, "worker_host")
    for unnamed in ("198.18.0.12", "127.0.0.1", "n2.fleet.lan", "a.b.gpu.lan", "gpu.lan"):
        with pytest.raises(ConfigError) as err:
            tls.check_host(unnamed, "worker_host")
        assert err.value.field == "worker_host"
        assert repr(unnamed) in err.value.message and "198.18.0.11" in err.value.message
