"""A fleet PKI issued into a temporary directory and the daemon's registry API served over real
TLS on loopback, the way the daemon serves it: an mTLS port for agents and certificate-holding
operators, a TLS-only port for operators with bearer tokens, one interceptor on both.

The servicers are the product's own (``fleet_api.bindings``), unwrapped: every check a test
here asserts is the one the daemon runs, so removing it from the product fails the test."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_daemon.api import fleet as fleet_api
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_rpc import pki
from fleetshift_rpc.auth import AuthInterceptor, AuthPolicy
from fleetshift_rpc.ratelimit import RateLimit, RateLimiter
from fleetshift_rpc.security import (
    OperatorTokens,
    TlsFiles,
    client_credentials,
    hash_token,
)
from fleetshift_rpc.server import RunningServer, start_server

MAX_MESSAGE = 64 * 1024
OPERATOR_TOKEN = "s3cret-operator-token"


@dataclass(frozen=True)
class Certs:
    ca: Path
    daemon: pki.IssuedPair
    node_a: pki.IssuedPair
    node_b: pki.IssuedPair
    operator: pki.IssuedPair
    foreign_ca: Path
    foreign_node_a: pki.IssuedPair  # claims node-a, signed by another CA


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    home = tmp_path_factory.mktemp("pki")
    other = tmp_path_factory.mktemp("other-pki")
    pki.init_ca(home)
    pki.init_ca(other, "Somebody else's CA")
    loopback = {"san_ips": ["127.0.0.1"], "san_dns": ["localhost"]}
    return Certs(
        ca=home / pki.CA_CERT,
        daemon=pki.issue(home, "daemon", "fleetshiftd", **loopback),  # type: ignore[arg-type]
        node_a=pki.issue(home, "node", "node-a"),
        node_b=pki.issue(home, "node", "node-b"),
        operator=pki.issue(home, "operator", "alice"),
        foreign_ca=other / pki.CA_CERT,
        foreign_node_a=pki.issue(other, "node", "node-a"),
    )


@dataclass
class SecureFleet:
    registry: Registry
    mtls: RunningServer
    tls: RunningServer
    limiter: RateLimiter | None
    certs: Certs

    def channel(
        self, pair: pki.IssuedPair | None, token: str | None = None, mtls: bool = True
    ) -> grpc.aio.Channel:
        """A client as an agent or operator would build it: the fleet CA, its own certificate
        (if any), and a bearer token sent as call credentials (if any)."""
        creds = client_credentials(
            str(self.certs.ca),
            str(pair.cert) if pair else "",
            str(pair.key) if pair else "",
            token or "",
        )
        port = self.mtls.port if mtls else self.tls.port
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds)

    def agents(self, ch: grpc.aio.Channel) -> pb_grpc.AgentRegistryStub:
        return pb_grpc.AgentRegistryStub(ch)

    def operator(self, ch: grpc.aio.Channel) -> pb_grpc.FleetOperatorStub:
        return pb_grpc.FleetOperatorStub(ch)


@asynccontextmanager
async def secure_fleet(
    tmp_path: Path,
    certs: Certs,
    policy: AuthPolicy | None = None,
    limit: RateLimit | None = None,
    tokens: OperatorTokens | None = None,
) -> AsyncIterator[SecureFleet]:
    engine = make_engine(f"sqlite:///{tmp_path / 'fleetshift.db'}")
    upgrade(engine)
    registry = Registry(SqlRegistryStore(engine), time.time, 10.0)
    registry.load()
    if tokens is None:
        tokens = OperatorTokens.parse([f"alice {hash_token(OPERATOR_TOKEN)}"])
    limiter = RateLimiter(limit) if limit else None
    interceptor = AuthInterceptor(policy or AuthPolicy(), tokens, limiter)
    files = TlsFiles(str(certs.daemon.cert), str(certs.daemon.key), str(certs.ca))
    bindings = fleet_api.bindings(registry, 200)  # the product's own servicers, unchanged
    mtls = await start_server(
        "127.0.0.1:0", bindings, MAX_MESSAGE, files.server_credentials(), [interceptor]
    )
    tls = await start_server(
        "127.0.0.1:0",
        bindings,
        MAX_MESSAGE,
        files.server_credentials(require_client_cert=False),
        [interceptor],
    )
    try:
        yield SecureFleet(registry, mtls, tls, limiter, certs)
    finally:
        await mtls.server.stop(0)
        await tls.server.stop(0)
        engine.dispose()


GiB = 1024**3


def registration(name: str) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(
        node_name=name,
        agent_address="127.0.0.1:50052",
        gpus=[
            pb.Gpu(
                index=0,
                product_name="NVIDIA H200",
                memory_bytes=141 * GiB,
                compute_capability="9.0",
            )
        ],
        versions=pb.NodeVersions(driver="550.54", cuda="12.4", torch="2.13.0", agent="0.1.0"),
        inventory_source=pb.INVENTORY_SOURCE_DECLARED,
    )
