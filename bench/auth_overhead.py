"""What identity and access cost on the heartbeat path: plaintext vs mTLS + the auth interceptor.

Why a baseline in the same run: loopback gRPC latency depends on the machine and its load, so
each configuration is measured in the same process, interleaved round by round, and printed
next to the plaintext server without any interceptor (the code as it was before security),
with the ratio. Every configuration serves the real fleet servicers over a real SQLite
registry; the client is one channel making sequential Heartbeat calls (each one a full round
trip: interceptor, identity check, registry update).

Configurations:
* ``plaintext``: no interceptor (baseline);
* ``plaintext+auth``: the interceptor on plaintext loopback (development trust) with the rate
  limiter;
* ``mtls+auth``: mTLS with a node certificate, the interceptor with the rate limiter, and the
  servicer's ``require_node_identity`` check.

Usage: python bench/auth_overhead.py [--calls 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetshift.v1 import fleet_pb2 as pb  # noqa: E402
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc  # noqa: E402
from fleetshift_daemon.api import convert  # noqa: E402
from fleetshift_daemon.api import fleet as fleet_api  # noqa: E402
from fleetshift_daemon.core.registry import Registry  # noqa: E402
from fleetshift_daemon.store.database import make_engine, upgrade  # noqa: E402
from fleetshift_daemon.store.registry_store import SqlRegistryStore  # noqa: E402
from fleetshift_rpc import pki  # noqa: E402
from fleetshift_rpc.auth import AuthInterceptor, AuthPolicy  # noqa: E402
from fleetshift_rpc.errors import rpc_errors  # noqa: E402
from fleetshift_rpc.ratelimit import RateLimit, RateLimiter  # noqa: E402
from fleetshift_rpc.security import TlsFiles, client_credentials  # noqa: E402
from fleetshift_rpc.server import ServiceBinding, start_server  # noqa: E402
from tests.security.conftest import checked_bindings, registration  # noqa: E402


class UncheckedAgentRegistry(fleet_api.AgentRegistryServicer):
    """Heartbeat as it was before the identity hook (so the baseline stays the pre-security
    code path even once the real servicer calls ``require_node_identity``)."""

    @rpc_errors
    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        workers = [convert.counters(w) for w in request.workers]
        node = self._registry.heartbeat(request.node_name, workers)
        return pb.HeartbeatResponse(state=convert.node_pb(node).state, cordoned=node.cordoned)


def unchecked_bindings(registry: Registry) -> list[ServiceBinding]:
    return [
        ServiceBinding(b.add_to_server, UncheckedAgentRegistry(registry, 1000), b.full_name)
        if b.full_name.endswith(".AgentRegistry")
        else b
        for b in fleet_api.bindings(registry, 1000)
    ]


async def measure(stub: pb_grpc.AgentRegistryStub, calls: int) -> list[float]:
    beat = pb.HeartbeatRequest(node_name="node-a")
    for _ in range(50):  # warm the connection and the caches
        await stub.Heartbeat(beat)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        await stub.Heartbeat(beat)
        out.append(time.perf_counter() - start)
    return out


async def main(calls: int, rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="auth-bench-"))
    pki.init_ca(work)
    server_pair = pki.issue(work, "daemon", "d", san_ips=["127.0.0.1"])
    node = pki.issue(work, "node", "node-a")
    ca = str(work / "ca.crt")
    engine = make_engine(f"sqlite:///{work / 'fleetshift.db'}")
    upgrade(engine)
    registry = Registry(SqlRegistryStore(engine), time.time, 60.0)
    big = RateLimit(rate_per_s=1e9, burst=10**9)

    def interceptor() -> AuthInterceptor:
        return AuthInterceptor(AuthPolicy(), None, RateLimiter(big))

    files = TlsFiles(str(server_pair.cert), str(server_pair.key), ca)
    servers = {
        "plaintext": await start_server("127.0.0.1:0", fleet_api.bindings(registry, 1000), 1 << 22),
        "plaintext+auth": await start_server(
            "127.0.0.1:0", checked_bindings(registry), 1 << 22, interceptors=[interceptor()]
        ),
        "mtls+auth": await start_server(
            "127.0.0.1:0",
            checked_bindings(registry),
            1 << 22,
            files.server_credentials(),
            [interceptor()],
        ),
    }
    channels = {
        "plaintext": grpc.aio.insecure_channel(f"127.0.0.1:{servers['plaintext'].port}"),
        "plaintext+auth": grpc.aio.insecure_channel(f"127.0.0.1:{servers['plaintext+auth'].port}"),
        "mtls+auth": grpc.aio.secure_channel(
            f"127.0.0.1:{servers['mtls+auth'].port}",
            client_credentials(ca, str(node.cert), str(node.key)),
        ),
    }
    await pb_grpc.AgentRegistryStub(channels["mtls+auth"]).RegisterNode(registration("node-a"))
    samples: dict[str, list[float]] = {name: [] for name in servers}
    for _ in range(rounds):
        for name, ch in channels.items():
            samples[name] += await measure(pb_grpc.AgentRegistryStub(ch), calls)
    base = statistics.median(samples["plaintext"])
    print(f"Heartbeat round trip on loopback, {rounds} x {calls} calls per configuration")
    print(f"{'configuration':<16} {'median us':>10} {'p99 us':>10} {'median / baseline':>18}")
    for name, values in samples.items():
        values.sort()
        median = statistics.median(values)
        p99 = values[int(len(values) * 0.99)]
        print(f"{name:<16} {median * 1e6:>10.0f} {p99 * 1e6:>10.0f} {median / base:>18.2f}")
    for ch in channels.values():
        await ch.close()
    for server in servers.values():
        await server.server.stop(0)
    engine.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds))
