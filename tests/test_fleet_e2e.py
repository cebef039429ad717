"""A local fleet of real processes, driven the way an operator would: grpcurl and SIGKILL."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec

pytestmark = pytest.mark.slow

NODES = (
    NodeSpec("a100-1", "NVIDIA A100-SXM4-80GB", 2),
    NodeSpec("h100-1", "NVIDIA H100 80GB HBM3", 2),
    NodeSpec("h200-1", "NVIDIA H200", 1),
)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    local = LocalFleet(tmp_path / "fleet", NODES, heartbeat_interval_s=0.3, node_lost_after_s=2.0)
    try:
        local.start(timeout_s=60)
        yield local
    finally:
        local.stop()


def run_grpcurl(
    binary: str, fleet: LocalFleet, *args: str, data: dict | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [binary, "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [fleet.daemon_address, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def test_operator_drives_the_fleet_with_grpcurl(fleet: LocalFleet, grpcurl: str) -> None:
    services = grpcurl_ok(grpcurl, fleet, "list").split()
    assert {
        "fleetshift.v1.AgentRegistry",
        "fleetshift.v1.FleetOperator",
        "grpc.health.v1.Health",
    } <= set(services)

    described = grpcurl_ok(grpcurl, fleet, "describe", "fleetshift.v1.FleetOperator")
    assert "rpc CordonNode" in described and "rpc ListNodes" in described
    assert "int64 memory_bytes" in grpcurl_ok(grpcurl, fleet, "describe", "fleetshift.v1.Gpu")

    health = json.loads(grpcurl_ok(grpcurl, fleet, "grpc.health.v1.Health/Check"))
    assert health["status"] == "SERVING"

    listed = json.loads(
        grpcurl_ok(grpcurl, fleet, "fleetshift.v1.FleetOperator/ListNodes", data={})
    )
    by_name = {n["name"]: n for n in listed["nodes"]}
    assert set(by_name) == {"a100-1", "h100-1", "h200-1"}
    assert all(n["state"] == "NODE_STATE_READY" for n in by_name.values())
    assert all(n["inventory_source"] == "INVENTORY_SOURCE_DECLARED" for n in by_name.values())
    assert [g["product_name"] for g in by_name["h200-1"]["gpus"]] == ["NVIDIA H200"]

    cordoned = json.loads(
        grpcurl_ok(
            grpcurl,
            fleet,
            "fleetshift.v1.FleetOperator/CordonNode",
            data={"node_name": "h100-1", "reason": "firmware update"},
        )
    )
    assert cordoned["cordoned"] is True and cordoned["cordon_reason"] == "firmware update"
    assert {n.name: n.cordoned for n in fleet.list_nodes()} == {
        "a100-1": False,
        "h100-1": True,
        "h200-1": False,
    }

    missing = run_grpcurl(
        grpcurl, fleet, "fleetshift.v1.FleetOperator/CordonNode", data={"node_name": "nope"}
    )
    assert missing.returncode != 0
    assert "NotFound" in missing.stderr and "nope" in missing.stderr


def grpcurl_ok(binary: str, fleet: LocalFleet, *args: str, data: dict | None = None) -> str:
    result = run_grpcurl(binary, fleet, *args, data=data)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_daemon_sigkill_loses_nothing_and_agents_resume(fleet: LocalFleet) -> None:
    fleet.list_nodes()
    with_cordon = {"h200-1"}
    from fleetshift_daemon.cli.main import main as cli

    assert cli(["--daemon", fleet.daemon_address, "cordon", "h200-1", "--reason", "test"]) == 0
    fleet.kill_daemon()
    fleet.start_daemon()  # same port, same SQLite file
    names = {s.name for s in NODES}
    # Restarted daemon knows every node from its database, before any agent re-registers.
    assert {n.name for n in fleet.list_nodes()} == names
    nodes = fleet.wait_ready(names, timeout_s=20)
    assert {n.name for n in nodes if n.cordoned} == with_cordon
    # Agents keep heartbeating the new process: nodes stay ready past the lost timeout.
    import time

    time.sleep(3.0)
    assert all(n.state == pb.NODE_STATE_READY for n in fleet.list_nodes())


def test_killed_agent_turns_lost_and_ready_when_back(fleet: LocalFleet) -> None:
    import time

    fleet.kill_agent("h100-1")
    killed_at = time.monotonic()
    fleet.wait_state({"h100-1"}, pb.NODE_STATE_LOST, timeout_s=10)
    # Lost within the configured timeout (2 s) plus one sweep and one poll of slack.
    assert time.monotonic() - killed_at < 2.0 + 1.5
    others = {n.name: n.state for n in fleet.list_nodes() if n.name != "h100-1"}
    assert set(others.values()) == {pb.NODE_STATE_READY}
    fleet.start_agent(NODES[1])
    fleet.wait_ready({"h100-1"}, timeout_s=10)
