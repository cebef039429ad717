"""The documented authentication rule on the real daemon: "client certificate, else bearer
token" (issue 13 items 3 and 13).

The daemon here is the product's own (``fleetshift_daemon.app.Daemon``) with mTLS on its main
port and a TLS-only port for operators with tokens; the PKI and the tokens file are made by the
product's own ``fleetshift certs`` code. A node's certificate plus a valid operator token must
stay a node; a certificate from another CA gains nothing with a token either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.config import DaemonConfig
from fleetshift_daemon.app import Daemon
from fleetshift_rpc import pki
from fleetshift_rpc.security import client_credentials

Code = grpc.StatusCode
GiB = 1024**3


@dataclass(frozen=True)
class Pki:
    ca: Path
    daemon: pki.IssuedPair
    node: pki.IssuedPair
    operator: pki.IssuedPair
    foreign_operator: pki.IssuedPair  # claims operator "alice", signed by another CA
    token: str
    tokens_file: Path


@pytest.fixture
def fleet_pki(tmp_path: Path) -> Pki:
    home, other = tmp_path / "pki", tmp_path / "other-pki"
    pki.init_ca(home)
    pki.init_ca(other, "Somebody else's CA")
    tokens = tmp_path / "operator-tokens"
    return Pki(
        ca=home / pki.CA_CERT,
        daemon=pki.issue(home, "daemon", "fleetshiftd", san_ips=["127.0.0.1"]),
        node=pki.issue(home, "node", "node-a"),
        operator=pki.issue(home, "operator", "alice"),
        foreign_operator=pki.issue(other, "operator", "alice"),
        token=pki.new_token(tokens, "alice"),
        tokens_file=tokens,
    )


@pytest.fixture
async def secure_daemon(tmp_path: Path, fleet_pki: Pki) -> AsyncIterator[Daemon]:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        operator_listen="127.0.0.1:0",
        state_dir=str(tmp_path / "state"),
        tls_cert=str(fleet_pki.daemon.cert),
        tls_key=str(fleet_pki.daemon.key),
        tls_ca=str(fleet_pki.ca),
        operator_tokens_file=str(fleet_pki.tokens_file),
    )
    daemon = Daemon(config)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop(0.1)


def dial(
    daemon: Daemon, ca: Path, pair: pki.IssuedPair | None, token: str = "", mtls: bool = True
) -> grpc.aio.Channel:
    creds = client_credentials(
        str(ca), str(pair.cert) if pair else "", str(pair.key) if pair else "", token
    )
    assert daemon.operator_server is not None
    port = daemon.port if mtls else daemon.operator_server.port
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds)


async def register_node_a(daemon: Daemon, fleet_pki: Pki) -> None:
    async with dial(daemon, fleet_pki.ca, fleet_pki.node) as ch:
        await pb_grpc.AgentRegistryStub(ch).RegisterNode(
            pb.RegisterNodeRequest(
                node_name="node-a",
                agent_address="127.0.0.1:50052",
                gpus=[pb.Gpu(index=0, product_name="NVIDIA H200", memory_bytes=141 * GiB)],
                inventory_source=pb.INVENTORY_SOURCE_DECLARED,
            )
        )


async def refused(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def test_node_certificate_plus_operator_token_stays_a_node(
    secure_daemon: Daemon, fleet_pki: Pki
) -> None:
    await register_node_a(secure_daemon, fleet_pki)
    async with dial(secure_daemon, fleet_pki.ca, fleet_pki.node, fleet_pki.token) as ch:
        operator = pb_grpc.FleetOperatorStub(ch)
        err = await refused(operator.CordonNode(pb.CordonNodeRequest(node_name="node-a")))
        assert err.code() == Code.PERMISSION_DENIED
        assert "node:node-a may not call /fleetshift.v1.FleetOperator/CordonNode" in err.details()
        err = await refused(operator.ListNodes(pb.ListNodesRequest()))
        assert err.code() == Code.PERMISSION_DENIED
        # still the node it is: its own agent calls keep working with the token attached
        beat = await pb_grpc.AgentRegistryStub(ch).Heartbeat(
            pb.HeartbeatRequest(node_name="node-a")
        )
        assert beat.state == pb.NODE_STATE_READY
    assert secure_daemon.registry is not None
    assert not secure_daemon.registry.get("node-a").cordoned


async def test_the_token_alone_and_the_operator_certificate_alone_are_operators(
    secure_daemon: Daemon, fleet_pki: Pki
) -> None:
    await register_node_a(secure_daemon, fleet_pki)
    async with dial(secure_daemon, fleet_pki.ca, None, fleet_pki.token, mtls=False) as ch:
        node = await pb_grpc.FleetOperatorStub(ch).CordonNode(
            pb.CordonNodeRequest(node_name="node-a", reason="firmware")
        )
        assert node.cordoned
    async with dial(secure_daemon, fleet_pki.ca, fleet_pki.operator) as ch:
        node = await pb_grpc.FleetOperatorStub(ch).UncordonNode(
            pb.UncordonNodeRequest(node_name="node-a")
        )
        assert not node.cordoned


async def test_a_foreign_certificate_gains_nothing_with_a_token(
    secure_daemon: Daemon, fleet_pki: Pki
) -> None:
    """Another CA's certificate naming operator 'alice': the mTLS port refuses the handshake;
    the token-only port never asks for a certificate, so only the token counts there."""
    await register_node_a(secure_daemon, fleet_pki)
    cordon = pb.CordonNodeRequest(node_name="node-a")
    async with dial(secure_daemon, fleet_pki.ca, fleet_pki.foreign_operator, "guessed") as ch:
        err = await refused(pb_grpc.FleetOperatorStub(ch).CordonNode(cordon, timeout=5))
        assert err.code() == Code.UNAVAILABLE  # the TLS handshake itself fails
    foreign = fleet_pki.foreign_operator
    async with dial(secure_daemon, fleet_pki.ca, foreign, "guessed", mtls=False) as ch:
        err = await refused(pb_grpc.FleetOperatorStub(ch).CordonNode(cordon, timeout=5))
        assert err.code() == Code.PERMISSION_DENIED and "token" in err.details()
    async with dial(secure_daemon, fleet_pki.ca, foreign, mtls=False) as ch:
        err = await refused(pb_grpc.FleetOperatorStub(ch).CordonNode(cordon, timeout=5))
        assert err.code() == Code.UNAUTHENTICATED
    assert secure_daemon.registry is not None
    assert not secure_daemon.registry.get("node-a").cordoned


async def test_token_port_asks_for_a_token_not_a_certificate(
    secure_daemon: Daemon, fleet_pki: Pki
) -> None:
    async with dial(secure_daemon, fleet_pki.ca, None, mtls=False) as ch:
        err = await refused(pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest()))
    assert err.code() == Code.UNAUTHENTICATED
    assert "authorization: Bearer <token>" in err.details()
    assert "certificate" not in err.details()
