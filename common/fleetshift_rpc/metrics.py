"""Prometheus metrics of the daemon and the agent, and the /metrics endpoint that serves them.

The failure FleetShift exists for is silent: a worker in the wrong pool passes every health
check. The placement efficiency figure, the traffic mix it is computed from and the moves
that correct it are therefore first-class metrics, with alert rules in ``deploy/prometheus``
and a dashboard in ``deploy/grafana`` that use exactly the names defined here (a test keeps
them in step). Each process object owns its own ``CollectorRegistry`` (never the global one),
so several daemons and agents can run in one test process without clashing, and call sites
stay one line through the small typed helpers below.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from time import perf_counter
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import start_http_server

from fleetshift_common.config import ConfigError
from fleetshift_rpc.security import TlsFiles

PREFIX = "fleetshift_"

# Route is on every request's path: its buckets resolve tens of microseconds.
ROUTE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
# Heartbeat lag is judged against intervals of seconds.
LAG_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0)
# Snapshots span a small test model (kB) to a 70B model's weights and KV cache (100s of GB).
SIZE_BUCKETS = tuple(float(4**i * 1024) for i in range(2, 16))  # 16 KiB .. 1 TiB
# A heartbeat's round trip: milliseconds when the daemon keeps up, seconds when it queues, up to
# the agent's 5 s deadline.
HEARTBEAT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OPERATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def _rpc_refused(registry: CollectorRegistry) -> Counter:
    return Counter(
        "fleetshift_rpc_refused",
        "RPCs refused by authentication, authorization or rate limiting",
        ["method", "code"],
        registry=registry,
    )


class DaemonMetrics:
    """Everything the central daemon exports."""

    def __init__(self, version: str = "", registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.build = Info("fleetshift_daemon_build", "Version of the running daemon", registry=r)
        self.build.info({"version": version})
        self.fleet_gpus = Gauge(
            "fleetshift_fleet_gpus",
            "GPUs in the registry by GPU kind and node state (ready, lost, cordoned)",
            ["gpu_kind", "state"],
            registry=r,
        )
        self.fleet_nodes = Gauge(
            "fleetshift_fleet_nodes",
            "Nodes in the registry by state (ready, lost, cordoned)",
            ["state"],
            registry=r,
        )
        self.placement_efficiency = Gauge(
            "fleetshift_placement_efficiency",
            "Predicted goodput of the current placement over that of the best placement "
            "for the current traffic mix (1.0 = optimal)",
            registry=r,
        )
        self.placement_gain = Gauge(
            "fleetshift_placement_predicted_gain",
            "Goodput gain the planner predicts for moving to the best placement (ratio - 1)",
            registry=r,
        )
        self.slo_measured = Gauge(
            "fleetshift_slo_attainment_measured",
            "Share of requests meeting their SLO as the workers measured it (TTFT/TBT p50 and "
            "p99 of their heartbeats), per model",
            ["model"],
            registry=r,
        )
        self.slo_target = Gauge(
            "fleetshift_slo_attainment_target",
            "Share of requests that must meet the SLO, per model",
            ["model"],
            registry=r,
        )
        self.slo_predicted = Gauge(
            "fleetshift_slo_attainment_predicted",
            "Share of offered requests the performance model predicts the current placement "
            "serves within SLO (its gap to the measured share is the model's error)",
            registry=r,
        )
        self.arrival_rate = Gauge(
            "fleetshift_traffic_arrival_rate",
            "Requests per second over the traffic window, per model",
            ["model"],
            registry=r,
        )
        self.mean_prompt_tokens = Gauge(
            "fleetshift_traffic_mean_prompt_tokens",
            "Mean prompt length over the traffic window, per model",
            ["model"],
            registry=r,
        )
        self.mean_output_tokens = Gauge(
            "fleetshift_traffic_mean_output_tokens",
            "Mean (estimated) output length over the traffic window, per model",
            ["model"],
            registry=r,
        )
        self.prefill_decode_ratio = Gauge(
            "fleetshift_traffic_prefill_decode_ratio",
            "Prefill tokens per decode token over the traffic window, per model",
            ["model"],
            registry=r,
        )
        self.route_latency = Histogram(
            "fleetshift_route_latency_seconds",
            "Time to answer a Route call",
            buckets=ROUTE_BUCKETS,
            registry=r,
        )
        self.routes = Counter(
            "fleetshift_routes",
            "Route calls by outcome (routed, failed)",
            ["outcome"],
            registry=r,
        )
        # Looked up once: Route counts every call, and labels() takes a lock and a dict lookup.
        self._routed = self.routes.labels(outcome="routed")
        self._route_failed = self.routes.labels(outcome="failed")
        self.heartbeat_lag = Histogram(
            "fleetshift_heartbeat_lag_seconds",
            "Time between two heartbeats of the same node as the daemon received them",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.nodes_lost = Counter(
            "fleetshift_nodes_lost",
            "Times a node turned lost (no heartbeat within node_lost_after_s)",
            registry=r,
        )
        self.nodes_silent_unjudged = Gauge(
            "fleetshift_nodes_silent_unjudged",
            "Ready nodes silent past node_lost_after_s that the last sweep did not declare "
            "lost, because more than mass_silence_fraction of the fleet fell silent at once "
            "(the daemon suspects itself or its network); 0 normally",
            registry=r,
        )
        self.operations = Counter(
            "fleetshift_operations",
            "Finished operations by kind (rebalance, drain, move_worker) and outcome "
            "(succeeded, failed, cancelled)",
            ["kind", "outcome"],
            registry=r,
        )
        self.operation_duration = Histogram(
            "fleetshift_operation_duration_seconds",
            "Duration of finished operations",
            ["kind"],
            buckets=OPERATION_BUCKETS,
            registry=r,
        )
        self.bytes_moved = Counter(
            "fleetshift_bytes_moved",
            "Bytes transferred by move steps, by step kind (migrate, cold_start)",
            ["step_kind"],
            registry=r,
        )
        self.snapshot_size = Histogram(
            "fleetshift_snapshot_size_bytes",
            "Size of the snapshots taken by move steps",
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.snapshot_duration = Histogram(
            "fleetshift_snapshot_duration_seconds",
            "Duration of the snapshot phases of move steps (write, transfer, restore)",
            ["phase"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.session_pause = Histogram(
            "fleetshift_session_pause_seconds",
            "Longest pause a session saw during a move step",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.rpc_refused = _rpc_refused(r)

    # --- one-line helpers for call sites ----------------------------------------------------

    def set_fleet(self, gpus: Mapping[tuple[str, str], int], nodes: Mapping[str, int]) -> None:
        """Replace the fleet gauges: ``gpus[(gpu_kind, state)]`` and ``nodes[state]``; a kind or
        state absent from the mappings disappears from the scrape instead of going stale."""
        self.fleet_gpus.clear()
        for (kind, state), count in gpus.items():
            self.fleet_gpus.labels(gpu_kind=kind, state=state).set(count)
        self.fleet_nodes.clear()
        for state, count in nodes.items():
            self.fleet_nodes.labels(state=state).set(count)

    def set_efficiency(self, efficiency: float, predicted_gain: float = 0.0) -> None:
        self.placement_efficiency.set(efficiency)
        self.placement_gain.set(predicted_gain)

    def set_slo_attainment(
        self, measured: Mapping[str, float], target: float, predicted: float
    ) -> None:
        """Measured attainment per model (models without latency reports are absent)."""
        self.slo_measured.clear()
        self.slo_target.clear()
        for model, value in measured.items():
            self.slo_measured.labels(model=model).set(value)
            self.slo_target.labels(model=model).set(target)
        self.slo_predicted.set(predicted)

    def set_traffic(
        self,
        model: str,
        arrival_rate: float,
        mean_prompt_tokens: float,
        mean_output_tokens: float,
    ) -> None:
        self.arrival_rate.labels(model=model).set(arrival_rate)
        self.mean_prompt_tokens.labels(model=model).set(mean_prompt_tokens)
        self.mean_output_tokens.labels(model=model).set(mean_output_tokens)
        ratio = mean_prompt_tokens / mean_output_tokens if mean_output_tokens > 0 else 0.0
        self.prefill_decode_ratio.labels(model=model).set(ratio)

    def forget_model(self, model: str) -> None:
        """A model that left the traffic window stops being exported."""
        for gauge in (
            self.arrival_rate,
            self.mean_prompt_tokens,
            self.mean_output_tokens,
            self.prefill_decode_ratio,
        ):
            with suppress(KeyError):
                gauge.remove(model)

    @contextmanager
    def time_route(self) -> Iterator[None]:
        """``with metrics.time_route(): ...`` observes the latency and counts the outcome:
        ``routed`` unless the block raises (then ``failed``, re-raised)."""
        start = perf_counter()
        try:
            yield
        except BaseException:
            self._route_failed.inc()
            raise
        finally:
            self.route_latency.observe(perf_counter() - start)
        self._routed.inc()

    def route_done(self, seconds: float, *, ok: bool) -> None:
        """One Route answered (``ok``) or refused, ``seconds`` after it began: what
        ``time_route`` records, for a caller that times the call itself (RouteStream)."""
        self.route_latency.observe(seconds)
        (self._routed if ok else self._route_failed).inc()

    def observe_heartbeat(self, lag_s: float) -> None:
        self.heartbeat_lag.observe(lag_s)

    def node_lost(self, count: int = 1) -> None:
        self.nodes_lost.inc(count)

    def operation_finished(self, kind: str, outcome: str, duration_s: float | None) -> None:
        self.operations.labels(kind=kind, outcome=outcome).inc()
        if duration_s is not None:
            self.operation_duration.labels(kind=kind).observe(duration_s)

    def step_moved(
        self,
        step_kind: str,
        bytes_moved: int,
        snapshot_bytes: int = 0,
        phase_seconds: Mapping[str, float] | None = None,
        max_session_pause_s: float | None = None,
    ) -> None:
        self.bytes_moved.labels(step_kind=step_kind).inc(bytes_moved)
        if snapshot_bytes:
            self.snapshot_size.observe(snapshot_bytes)
        for phase, seconds in (phase_seconds or {}).items():
            self.snapshot_duration.labels(phase=phase).observe(seconds)
        if max_session_pause_s is not None:
            self.session_pause.observe(max_session_pause_s)

    def refused(self, method: str, code: object) -> None:
        """Fits ``AuthInterceptor(on_refused=metrics.refused)``."""
        self.rpc_refused.labels(method=method, code=getattr(code, "name", str(code))).inc()


class AgentMetrics:
    """Everything a node agent exports (its workers, snapshots and transfers)."""

    def __init__(
        self, node: str, version: str = "", registry: CollectorRegistry | None = None
    ) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.build = Info("fleetshift_agent_build", "Version and node of the agent", registry=r)
        self.build.info({"node": node, "version": version})
        self.workers = Gauge(
            "fleetshift_agent_workers",
            "Workers supervised by this agent by role and state",
            ["role", "state"],
            registry=r,
        )
        self.snapshot_write = Histogram(
            "fleetshift_agent_snapshot_write_seconds",
            "Time to write a snapshot (fsynced and renamed into place)",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.snapshot_restore = Histogram(
            "fleetshift_agent_snapshot_restore_seconds",
            "Time to restore a worker from a snapshot until it serves",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.snapshot_write_bytes = Counter(
            "fleetshift_agent_snapshot_write_bytes", "Bytes of snapshots written", registry=r
        )
        self.snapshot_restore_bytes = Counter(
            "fleetshift_agent_snapshot_restore_bytes", "Bytes of snapshots restored", registry=r
        )
        self.transfer_bytes = Counter(
            "fleetshift_agent_transfer_bytes",
            "Snapshot bytes transferred between agents (direction: sent, received)",
            ["direction"],
            registry=r,
        )
        self.heartbeats = Counter(
            "fleetshift_agent_heartbeats",
            "Heartbeats this agent sent, per daemon replica and outcome (answered, timed_out: "
            "the daemon is there but slow; unreachable; not_found: it lost the node; refused)",
            ["daemon", "outcome"],
            registry=r,
        )
        self.heartbeat_round_trip = Histogram(
            "fleetshift_agent_heartbeat_seconds",
            "Round trip of an answered heartbeat, per daemon replica (the daemon's queue, seen "
            "from the node)",
            ["daemon"],
            buckets=HEARTBEAT_BUCKETS,
            registry=r,
        )
        self.rpc_refused = _rpc_refused(r)

    def heartbeat(self, daemon: str, outcome: str, seconds: float) -> None:
        self.heartbeats.labels(daemon=daemon, outcome=outcome).inc()
        if outcome == "answered":
            self.heartbeat_round_trip.labels(daemon=daemon).observe(seconds)

    def set_workers(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Replace the worker gauge: ``counts[(role, state)]``."""
        self.workers.clear()
        for (role, state), count in counts.items():
            self.workers.labels(role=role, state=state).set(count)

    def snapshot_written(self, seconds: float, size_bytes: int) -> None:
        self.snapshot_write.observe(seconds)
        self.snapshot_write_bytes.inc(size_bytes)

    def snapshot_restored(self, seconds: float, size_bytes: int) -> None:
        self.snapshot_restore.observe(seconds)
        self.snapshot_restore_bytes.inc(size_bytes)

    def transferred(self, direction: str, size_bytes: int) -> None:
        self.transfer_bytes.labels(direction=direction).inc(size_bytes)

    def refused(self, method: str, code: object) -> None:
        self.rpc_refused.labels(method=method, code=getattr(code, "name", str(code))).inc()


# --- the /metrics endpoint --------------------------------------------------------------------


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    tls: TlsFiles | None = None,
) -> MetricsEndpoint:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; port 0 picks a
    free port (read it back from ``.port``). With ``tls`` it is HTTPS and the scraper must
    present a certificate of the fleet CA. Loopback by default: metrics name nodes and models.
    """
    kwargs: dict[str, object] = {}
    if tls is not None:
        kwargs = {
            "certfile": tls.cert,
            "keyfile": tls.key,
            "client_cafile": tls.ca,
            "client_auth_required": True,
        }
    server, thread = start_http_server(port, host, registry, **kwargs)  # type: ignore[arg-type]
    return MetricsEndpoint(server, thread)


def parse_listen(listen: str, key: str = "metrics_listen") -> tuple[str, int]:
    """``host:port`` of a config key into its parts (the key named when it is malformed)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"config key '{key}' must be host:port, got {listen!r}", field=key)
    return host.strip("[]"), int(port)


def metric_names(registry: CollectorRegistry) -> frozenset[str]:
    """Every sample name ``registry`` can export, suffixes included (``_total``, ``_bucket``,
    ``_sum``, ``_count``, ``_created``, ``_info``), whether or not it has samples yet."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created"),
        "gauge": ("",),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return frozenset(names)
