"""The node agent: inventory, its own API, and staying registered whatever the daemon does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2, agent_pb2_grpc
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_agent.app import Agent
from fleetshift_agent.discovery import DECLARED, NvmlUnavailable, discover, nvml_inventory
from fleetshift_common.config import AgentConfig, DaemonConfig, DeclaredGpu
from fleetshift_daemon.app import Daemon

H200 = (DeclaredGpu("NVIDIA H200", 2),)


def nvml_present() -> bool:
    try:
        nvml_inventory()
    except NvmlUnavailable:
        return False
    return True


def agent_config(daemon_port: int, name: str = "node-x", **kw: object) -> AgentConfig:
    return AgentConfig(
        node_name=name,
        listen="127.0.0.1:0",
        daemon_address=f"127.0.0.1:{daemon_port}",
        inventory="declared",
        gpus=H200,
        reconnect_initial_s=0.05,
        reconnect_max_s=0.2,
        state_dir=tempfile.mkdtemp(prefix="fleetshift-agent-test-"),
        **kw,  # type: ignore[arg-type]
    )


def test_declared_inventory_fills_in_known_products() -> None:
    inv = discover(
        AgentConfig(
            inventory="declared", gpus=(DeclaredGpu("H200", 2), DeclaredGpu("NVIDIA L40S", 1))
        )
    )
    assert inv.source == DECLARED
    assert [g.product_name for g in inv.gpus] == ["NVIDIA H200", "NVIDIA H200", "NVIDIA L40S"]
    assert inv.gpus[0].memory_bytes == 141 * 1024**3 and inv.gpus[0].fp8_supported
    assert inv.gpus[0].nvlink_peers == (1,) and inv.gpus[2].nvlink_peers == ()


def test_auto_inventory_falls_back_to_declared_without_nvml() -> None:
    inv = discover(AgentConfig(inventory="auto", gpus=H200))
    assert inv.source == ("nvml" if nvml_present() else DECLARED)


def test_nvml_only_agent_refuses_to_start_without_nvml(tmp_path: Path) -> None:
    if nvml_present():
        pytest.skip("this machine has NVML: the refusal cannot happen here")
    config = tmp_path / "agent.toml"
    config.write_text('inventory = "nvml"\nlisten = "127.0.0.1:0"\n')
    result = subprocess.run(
        [sys.executable, "-m", "fleetshift_agent.main", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "NVML" in result.stderr


async def test_agent_reports_declared_inventory_and_registration(daemon: Daemon) -> None:
    agent = Agent(agent_config(daemon.port))
    await agent.start()
    try:
        assert agent.membership is not None
        await asyncio.wait_for(agent.membership.registered.wait(), 5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
            info = await agent_pb2_grpc.AgentServiceStub(ch).GetAgentInfo(
                agent_pb2.GetAgentInfoRequest()
            )
        assert info.registered and info.inventory_source == pb.INVENTORY_SOURCE_DECLARED
        assert len(info.gpus) == 2
        assert daemon.registry is not None
        node = daemon.registry.get("node-x")
        assert node.agent_address == f"127.0.0.1:{agent.port}"
    finally:
        await agent.stop()


async def test_agent_started_before_the_daemon_registers_when_it_appears(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = Agent(agent_config(port))
    await agent.start()
    late = Daemon(
        DaemonConfig(
            listen=f"127.0.0.1:{port}",
            state_dir=str(tmp_path),
            heartbeat_interval_s=0.2,
            node_lost_after_s=1.0,
        )
    )
    try:
        await asyncio.sleep(0.5)  # a few failed attempts first
        assert agent.membership is not None and not agent.membership.registered.is_set()
        await late.start()
        await asyncio.wait_for(agent.membership.registered.wait(), 5)
        assert late.registry is not None and late.registry.get("node-x").name == "node-x"
    finally:
        await agent.stop()
        await late.stop(0.1)


async def test_agent_reregisters_with_a_daemon_that_forgot_it(tmp_path: Path) -> None:
    """A daemon with a wiped database answers NOT_FOUND to heartbeats; the agent registers anew."""
    first = Daemon(
        DaemonConfig(
            listen="127.0.0.1:0",
            state_dir=str(tmp_path / "a"),
            heartbeat_interval_s=0.2,
            node_lost_after_s=1.0,
        )
    )
    await first.start()
    port = first.port
    agent = Agent(agent_config(port))
    await agent.start()
    assert agent.membership is not None
    await asyncio.wait_for(agent.membership.registered.wait(), 5)
    await first.stop(0.1)
    second = Daemon(
        DaemonConfig(
            listen=f"127.0.0.1:{port}",
            state_dir=str(tmp_path / "b"),
            heartbeat_interval_s=0.2,
            node_lost_after_s=1.0,
        )
    )
    await second.start()
    try:
        # The daemon stores the node before the agent has read the answer to its Register
        # call: wait for both (a loaded machine widened that gap past the first check).
        for _ in range(100):
            if (
                second.registry is not None
                and second.registry.nodes()
                and agent.membership.registrations >= 2
            ):
                break
            await asyncio.sleep(0.05)
        assert second.registry is not None
        assert [n.name for n in second.registry.nodes()] == ["node-x"]
        assert agent.membership.registrations >= 2
    finally:
        await agent.stop()
        await second.stop(0.1)
