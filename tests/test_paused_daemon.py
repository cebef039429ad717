"""A daemon paused past the lost timeout (SIGSTOP: a saturated host, a stalled VM) and resumed.

Neither side may turn the daemon's stall into the node's fault: the daemon, whose own loop
could not hear during the pause, declares no node lost for it (core/hearing.py), and the
agent, whose heartbeats time out against a daemon that is there but slow, heartbeats on
instead of registering again (a registration is a database write per node, the last thing a
saturated daemon needs from every agent at once). A real daemon process, the agent's real
membership loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_agent import membership as membership_module
from fleetshift_agent.membership import Backoff, Membership

from .test_registry_api import registration

LOST_AFTER_S = 1.5


def start_daemon(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    config, port_file, log = tmp_path / "d.toml", tmp_path / "port", tmp_path / "daemon.log"
    config.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{tmp_path}"\nport_file = "{port_file}"\n'
        f"heartbeat_interval_s = 0.2\nnode_lost_after_s = {LOST_AFTER_S}\n"
        "liveness_check_interval_s = 0.1\n"
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the daemon did not start"
        time.sleep(0.05)
    return proc, int(port_file.read_text()), log


async def answered_more(answered: list[pb.HeartbeatRequest], than: int) -> None:
    for _ in range(200):
        if len(answered) > than:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no heartbeat answered after {than}")


async def test_a_paused_daemon_loses_no_node_and_the_agent_does_not_register_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership_module, "RPC_TIMEOUT_S", 0.5)  # timeouts within the pause
    proc, port, log = start_daemon(tmp_path)
    answered: list[pb.HeartbeatRequest] = []
    membership = Membership(
        f"127.0.0.1:{port}",
        registration=lambda: registration("node-p"),
        heartbeat=lambda: pb.HeartbeatRequest(node_name="node-p"),
        backoff=Backoff(0.05, 0.5),
        max_message_bytes=4 << 20,
        heartbeat_sent=answered.append,
    )
    task = asyncio.create_task(membership.run())
    try:
        await answered_more(answered, 3)
        os.kill(proc.pid, signal.SIGSTOP)
        await asyncio.sleep(2 * LOST_AFTER_S)  # heartbeats time out meanwhile
        before = len(answered)
        os.kill(proc.pid, signal.SIGCONT)
        await answered_more(answered, before + 5)
        await asyncio.sleep(0.5)  # sweeps after the pause
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)
    assert membership.registrations == 1
    assert "node lost" not in log.read_text()
