"""What Prometheus would scrape from a real daemon and real agents after a real warm move.

One fleet (a daemon and two agents, each serving ``/metrics``) starts a worker, streams
sessions routed through ``Placement/Route`` and followed through ``LocateSession``, and moves
the worker to the other node while they stream. Each series is scraped over HTTP before and
after and must have changed by what happened: one snapshot written on the source agent, sent
to and received by the target agent and restored there, byte for byte the size of the snapshot
directories on disk; one move operation on the daemon with its phase durations and pause. The
dashboard's and the alert rules' queries may only name series these processes export.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import routed_session
from tests.e2e.conftest import MODEL, NODES, SESSIONS, request
from tests.observability.promql import (
    PROMETHEUS_OWN,
    alert_queries,
    dashboard_queries,
    metric_names_in,
)

pytestmark = pytest.mark.slow
# Long enough to still stream when the warm move copies its sessions, as the other e2e move
# tests' 700: with 300, a CI rehearsal at load ~4 saw every stream end before the copy.
TOKENS = 700
SOURCE, TARGET = "h100-a", "h100-b"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Scrape:
    samples: Samples
    names: frozenset[str]  # every series name the process exports, with or without samples

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), 0.0)


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples: Samples = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
            names.add(s.name)
    return Scrape(samples, frozenset(names))


@dataclass(frozen=True)
class Moved:
    before: dict[str, Scrape]  # "daemon" or node name -> scrape
    after: dict[str, Scrape]
    op: pb.Operation
    source_snapshot: Path
    target_snapshot: Path

    def delta(self, process: str, name: str, **labels: str) -> float:
        return self.after[process].get(name, **labels) - self.before[process].get(name, **labels)


def disk_bytes(snapshot: Path) -> tuple[int, int]:
    """All bytes of a snapshot directory, and those of its data files (manifest excluded)."""
    files = [p for p in snapshot.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    return total, total - (snapshot / "manifest.json").stat().st_size


def scrape_all(fleet: LocalFleet) -> dict[str, Scrape]:
    return {process: scrape(port) for process, port in fleet.metrics_ports.items()}


async def move_while_routed_sessions_stream(
    fleet: LocalFleet,
) -> tuple[dict[str, Scrape], pb.Operation]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await ops.StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name=SOURCE),
            timeout=180,
        )
        before = await asyncio.to_thread(scrape_all, fleet)
        seen: dict[str, int] = {}
        started = asyncio.Event()

        async def one(session: tuple[str, list[int], float, int | None]) -> int:
            route = ppb.RouteRequest(model=MODEL, prompt_tokens=len(session[1]))
            count = 0
            async for _ in routed_session(daemon, route, request(session, TOKENS)):
                count += 1
                seen[session[0]] = count
                if len(seen) == len(SESSIONS) and min(seen.values()) >= 20:
                    started.set()
            return count

        streams = asyncio.gather(*(one(s) for s in SESSIONS))
        await asyncio.wait_for(started.wait(), 60)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=TARGET), timeout=30
        )
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
        assert await asyncio.wait_for(streams, 180) == [TOKENS] * len(SESSIONS)
        return before, op


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Moved]:
    root = tmp_path_factory.mktemp("metrics-fleet")
    fleet = LocalFleet(
        root,
        [n for n in NODES if n.name in (SOURCE, TARGET)],
        heartbeat_interval_s=0.3,
        metrics=True,
        daemon_extra=(
            "[planner]\ninterval_s = 1\n"  # publishes efficiency and the traffic mix
            f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
            "tp_options = [1]\n"
        ),
        agent_extra="worker_compile = false\nworker_threads = 1\n",
    )
    try:
        fleet.start(timeout_s=120)
        before, op = asyncio.run(move_while_routed_sessions_stream(fleet))
        deadline = time.monotonic() + 30  # the next planning pass publishes the traffic mix
        while True:
            after = scrape_all(fleet)
            if after["daemon"].get("fleetshift_traffic_arrival_rate", model=MODEL) > 0:
                break
            assert time.monotonic() < deadline, "no planning pass published the traffic mix"
            time.sleep(0.3)
        sid = op.steps[0].snapshot_id
        yield Moved(
            before,
            after,
            op,
            root / f"agent-{SOURCE}" / "snapshots" / sid,
            root / f"agent-{TARGET}" / "snapshots" / sid,
        )
    finally:
        fleet.stop()


def test_the_move_ran_warm(moved: Moved) -> None:
    assert moved.op.state == pb.OPERATION_STATE_SUCCEEDED, moved.op
    step = moved.op.steps[0]
    assert step.kind == pb.STEP_KIND_MIGRATE and step.sessions_carried >= 1
    assert moved.source_snapshot.is_dir() and moved.target_snapshot.is_dir()


def test_agents_count_the_snapshot_they_wrote_sent_received_and_restored(moved: Moved) -> None:
    total, data = disk_bytes(moved.source_snapshot)
    assert disk_bytes(moved.target_snapshot) == (total, data)  # the same snapshot, verified
    src, dst = SOURCE, TARGET
    assert moved.delta(src, "fleetshift_agent_snapshot_write_seconds_count") == 1
    assert moved.delta(src, "fleetshift_agent_snapshot_write_seconds_sum") > 0
    assert moved.delta(src, "fleetshift_agent_snapshot_write_bytes_total") == total
    assert moved.delta(src, "fleetshift_agent_transfer_bytes_total", direction="sent") == data
    assert moved.delta(dst, "fleetshift_agent_transfer_bytes_total", direction="received") == data
    assert moved.delta(dst, "fleetshift_agent_snapshot_restore_seconds_count") == 1
    assert moved.delta(dst, "fleetshift_agent_snapshot_restore_seconds_sum") > 0
    assert moved.delta(dst, "fleetshift_agent_snapshot_restore_bytes_total") == total
    # and nothing the other way round
    assert moved.delta(dst, "fleetshift_agent_snapshot_write_seconds_count") == 0
    assert moved.delta(src, "fleetshift_agent_snapshot_restore_seconds_count") == 0
    assert moved.delta(src, "fleetshift_agent_transfer_bytes_total", direction="received") == 0


def test_agents_export_the_workers_they_run(moved: Moved) -> None:
    serving = {"role": "mixed", "state": "serving"}
    assert moved.before[SOURCE].get("fleetshift_agent_workers", **serving) == 1
    assert moved.before[TARGET].get("fleetshift_agent_workers", **serving) == 0
    assert moved.after[SOURCE].get("fleetshift_agent_workers", **serving) == 0
    assert moved.after[TARGET].get("fleetshift_agent_workers", **serving) == 1


def test_daemon_exports_the_move_with_its_phases_and_pause(moved: Moved) -> None:
    step = moved.op.steps[0]
    d = "daemon"
    ok = {"kind": "move_worker", "outcome": "succeeded"}
    assert moved.delta(d, "fleetshift_operations_total", **ok) == 1
    assert moved.delta(d, "fleetshift_operation_duration_seconds_count", kind="move_worker") == 1
    duration = moved.delta(d, "fleetshift_operation_duration_seconds_sum", kind="move_worker")
    moved_bytes = moved.delta(d, "fleetshift_bytes_moved_total", step_kind="migrate")
    assert moved_bytes == step.bytes_moved >= disk_bytes(moved.source_snapshot)[0]
    phases = 0.0
    for phase in ("write", "transfer", "restore"):
        name = "fleetshift_snapshot_duration_seconds"
        assert moved.delta(d, f"{name}_count", phase=phase) == 1, phase
        seconds = moved.delta(d, f"{name}_sum", phase=phase)
        assert seconds > 0, phase
        phases += seconds
    assert phases < duration
    assert moved.delta(d, "fleetshift_session_pause_seconds_count") == 1
    pause = moved.delta(d, "fleetshift_session_pause_seconds_sum")
    assert pause == pytest.approx(step.max_session_pause_ms / 1000) and pause > 0
    assert moved.after[d].get("fleetshift_fleet_nodes", state="ready") == 2
    assert moved.after[d].get("fleetshift_routes_total", outcome="routed") >= len(SESSIONS)
    assert moved.after[d].get("fleetshift_heartbeat_lag_seconds_count") > 0


def test_daemon_snapshot_size_is_the_snapshot_on_disk(moved: Moved) -> None:
    assert moved.delta("daemon", "fleetshift_snapshot_size_bytes_count") == 1
    total, _ = disk_bytes(moved.source_snapshot)
    assert moved.delta("daemon", "fleetshift_snapshot_size_bytes_sum") == total


# Series only an event this fleet never has makes (a refused RPC): exported as a family, with
# no sample until the first refusal. Anything else a query names must have a sample here.
EVENT_ONLY = frozenset({"fleetshift_rpc_refused_total"})


def test_dashboard_and_alert_rules_query_only_series_the_processes_export(moved: Moved) -> None:
    exported = frozenset().union(*(s.names for s in moved.after.values()))
    with_samples = {name for s in moved.after.values() for name, _ in s.samples}
    queries = {f"dashboard: {q}": q for q in dashboard_queries()}
    queries |= {f"alert {name}: {q}": q for name, q in alert_queries().items()}
    assert len(queries) >= 30
    missing = {
        where: names
        for where, q in queries.items()
        if (names := metric_names_in(q) - exported - PROMETHEUS_OWN)
    }
    assert missing == {}
    silent = {
        where: names
        for where, q in queries.items()
        if (names := metric_names_in(q) - with_samples - PROMETHEUS_OWN - EVENT_ONLY)
    }
    assert silent == {}
