"""The /metrics endpoint as Prometheus sees it: scraped over HTTP and parsed by the reference
parser, after the one-line helpers the daemon and the agent call."""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.config import ConfigError
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_rpc import pki
from fleetshift_rpc.auth import AuthInterceptor, AuthPolicy
from fleetshift_rpc.metrics import (
    AgentMetrics,
    DaemonMetrics,
    MetricsEndpoint,
    parse_listen,
    start_metrics_server,
)
from fleetshift_rpc.security import TlsFiles
from fleetshift_rpc.server import start_server

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, context: ssl.SSLContext | None = None) -> Samples:
    scheme = "https" if context else "http"
    url = f"{scheme}://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5, context=context) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def daemon_metrics() -> Iterator[tuple[DaemonMetrics, MetricsEndpoint]]:
    metrics = DaemonMetrics(version="0.1.0")
    endpoint = start_metrics_server(metrics.registry, 0)
    try:
        yield metrics, endpoint
    finally:
        endpoint.stop()


def test_daemon_metrics_are_scraped_with_the_values_set(
    daemon_metrics: tuple[DaemonMetrics, MetricsEndpoint],
) -> None:
    metrics, endpoint = daemon_metrics
    assert endpoint.port > 0
    metrics.set_fleet(
        {("H100", "ready"): 16, ("H200", "ready"): 8, ("A100", "lost"): 4},
        {"ready": 3, "lost": 1},
    )
    metrics.set_efficiency(0.72, predicted_gain=0.31)
    metrics.set_traffic("llama2-70b", 12.5, mean_prompt_tokens=1200, mean_output_tokens=300)
    for _ in range(3):
        with metrics.time_route():
            pass
    with pytest.raises(LookupError), metrics.time_route():
        raise LookupError("no worker")
    metrics.observe_heartbeat(2.1)
    metrics.observe_heartbeat(12.0)
    metrics.node_lost()
    metrics.operation_finished("rebalance", "succeeded", 42.0)
    metrics.operation_finished("move_worker", "failed", None)
    metrics.step_moved("migrate", 3 * 2**30, snapshot_bytes=3 * 2**30, phase_seconds={"write": 1.5})
    metrics.step_moved("cold_start", 1000)

    s = scrape(endpoint.port)
    assert value(s, "fleetshift_fleet_gpus", gpu_kind="H200", state="ready") == 8
    assert value(s, "fleetshift_fleet_gpus", gpu_kind="A100", state="lost") == 4
    assert value(s, "fleetshift_fleet_nodes", state="lost") == 1
    assert value(s, "fleetshift_placement_efficiency") == pytest.approx(0.72)
    assert value(s, "fleetshift_placement_predicted_gain") == pytest.approx(0.31)
    assert value(s, "fleetshift_traffic_arrival_rate", model="llama2-70b") == 12.5
    assert value(s, "fleetshift_traffic_prefill_decode_ratio", model="llama2-70b") == 4.0
    assert value(s, "fleetshift_route_latency_seconds_count") == 4
    assert value(s, "fleetshift_routes_total", outcome="routed") == 3
    assert value(s, "fleetshift_routes_total", outcome="failed") == 1
    assert value(s, "fleetshift_heartbeat_lag_seconds_bucket", le="3.0") == 1
    assert value(s, "fleetshift_heartbeat_lag_seconds_bucket", le="+Inf") == 2
    assert value(s, "fleetshift_nodes_lost_total") == 1
    assert value(s, "fleetshift_operations_total", kind="move_worker", outcome="failed") == 1
    assert value(s, "fleetshift_operation_duration_seconds_sum", kind="rebalance") == 42.0
    assert value(s, "fleetshift_bytes_moved_total", step_kind="migrate") == 3 * 2**30
    assert value(s, "fleetshift_snapshot_size_bytes_count") == 1
    assert value(s, "fleetshift_snapshot_duration_seconds_sum", phase="write") == 1.5
    assert value(s, "fleetshift_daemon_build_info", version="0.1.0") == 1

    # the fleet shrinks: series of kinds that left disappear instead of going stale
    metrics.set_fleet({("H100", "ready"): 16}, {"ready": 1})
    metrics.forget_model("llama2-70b")
    s = scrape(endpoint.port)
    assert ("fleetshift_fleet_gpus", frozenset({("gpu_kind", "A100"), ("state", "lost")})) not in s
    assert value(s, "fleetshift_fleet_gpus", gpu_kind="H100", state="ready") == 16
    assert not any(name.startswith("fleetshift_traffic_") for name, _ in s)


def test_processes_in_one_interpreter_do_not_share_metrics() -> None:
    first, second = DaemonMetrics(), DaemonMetrics()
    agent = AgentMetrics("node-a", version="0.1.0")
    first.set_efficiency(0.5)
    second.set_efficiency(0.95)
    agent.set_workers({("decode", "serving"): 2, ("prefill", "serving"): 1})
    agent.snapshot_written(1.25, 1 << 20)
    agent.snapshot_restored(0.5, 1 << 20)
    agent.transferred("sent", 4096)
    endpoints = [start_metrics_server(m.registry, 0) for m in (first, second, agent)]
    try:
        s1, s2, sa = (scrape(e.port) for e in endpoints)
    finally:
        for e in endpoints:
            e.stop()
    assert value(s1, "fleetshift_placement_efficiency") == 0.5
    assert value(s2, "fleetshift_placement_efficiency") == 0.95
    assert value(sa, "fleetshift_agent_workers", role="decode", state="serving") == 2
    assert value(sa, "fleetshift_agent_snapshot_write_seconds_sum") == 1.25
    assert value(sa, "fleetshift_agent_snapshot_restore_bytes_total") == 1 << 20
    assert value(sa, "fleetshift_agent_transfer_bytes_total", direction="sent") == 4096
    assert value(sa, "fleetshift_agent_build_info", node="node-a", version="0.1.0") == 1
    assert not any(name.startswith("fleetshift_agent") for name, _ in s1)


def test_stopped_endpoint_frees_its_port() -> None:
    endpoint = start_metrics_server(DaemonMetrics().registry, 0)
    port = endpoint.port
    endpoint.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_metrics_over_mtls_need_a_fleet_certificate(tmp_path: Path) -> None:
    pki.init_ca(tmp_path)
    server = pki.issue(tmp_path, "daemon", "fleetshiftd", san_ips=["127.0.0.1"])
    scraper = pki.issue(tmp_path, "operator", "prometheus")
    ca = str(tmp_path / "ca.crt")
    metrics = DaemonMetrics()
    metrics.set_efficiency(0.9)
    endpoint = start_metrics_server(
        metrics.registry, 0, tls=TlsFiles(str(server.cert), str(server.key), ca)
    )
    try:
        trusted = ssl.create_default_context(cafile=ca)
        trusted.load_cert_chain(scraper.cert, scraper.key)
        assert value(scrape(endpoint.port, trusted), "fleetshift_placement_efficiency") == 0.9
        anonymous = ssl.create_default_context(cafile=ca)
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            scrape(endpoint.port, anonymous)
    finally:
        endpoint.stop()


async def test_refused_rpcs_are_counted(
    tmp_path: Path, daemon_metrics: tuple[DaemonMetrics, MetricsEndpoint]
) -> None:
    metrics, endpoint = daemon_metrics
    engine = make_engine(f"sqlite:///{tmp_path / 'fleetshift.db'}")
    upgrade(engine)
    from fleetshift_daemon.api import fleet as fleet_api

    registry = Registry(SqlRegistryStore(engine), time.time, 10.0)
    interceptor = AuthInterceptor(
        AuthPolicy(trust_plaintext_loopback=False), on_refused=metrics.refused
    )
    server = await start_server(
        "127.0.0.1:0", fleet_api.bindings(registry, 200), 1 << 20, interceptors=[interceptor]
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            for _ in range(2):
                with pytest.raises(grpc.aio.AioRpcError):
                    await pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest())
    finally:
        await server.server.stop(0)
        engine.dispose()
    s = scrape(endpoint.port)
    method = "/fleetshift.v1.FleetOperator/ListNodes"
    assert value(s, "fleetshift_rpc_refused_total", method=method, code="UNAUTHENTICATED") == 2


def test_metrics_listen_is_checked() -> None:
    assert parse_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ConfigError) as err:
        parse_listen("9464")
    assert err.value.field == "metrics_listen"
