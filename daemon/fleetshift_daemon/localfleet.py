"""A whole fleet on one machine: the daemon on SQLite plus agents with declared inventories.

It is the project's main demo and the harness of the end-to-end tests, so it runs the real
console entry points as separate processes (killable, restartable) rather than in-process
objects: what it shows is what systemd would run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class NodeSpec:
    name: str
    product_name: str
    gpu_count: int = 8


DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("a100-1", "NVIDIA A100-SXM4-80GB"),
    NodeSpec("h100-1", "NVIDIA H100 80GB HBM3"),
    NodeSpec("h100-2", "NVIDIA H100 80GB HBM3"),
    NodeSpec("h200-1", "NVIDIA H200"),
)


def _wait_for(path: Path, timeout_s: float, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s}s")


@dataclass
class LocalFleet:
    state_dir: Path
    nodes: Sequence[NodeSpec] = DEFAULT_NODES
    heartbeat_interval_s: float = 1.0
    node_lost_after_s: float = 5.0
    daemon_port: int = 0  # 0: pick a free port on first start, then keep it across restarts
    daemon_extra: str = ""  # TOML appended to the daemon's config (models, planner ...)
    agent_extra: str = ""  # TOML appended to every agent's config (before its [[gpus]])
    env: dict[str, str] = field(default_factory=dict)  # extra environment (failpoints ...)
    # True: every process serves /metrics on a loopback port of its own, kept across restarts
    # ("daemon" or the node name -> port), so a test can scrape what Prometheus would.
    metrics: bool = False
    metrics_ports: dict[str, int] = field(default_factory=dict)
    daemon_proc: subprocess.Popen[bytes] | None = None
    agent_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def daemon_address(self) -> str:
        return f"127.0.0.1:{self.daemon_port}"

    def _spawn(self, module: str, config: Path, log_name: str) -> subprocess.Popen[bytes]:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{log_name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        return subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def _metrics_line(self, process: str) -> str:
        if not self.metrics:
            return ""
        if process not in self.metrics_ports:
            self.metrics_ports[process] = _free_port()
        return f'metrics_listen = "127.0.0.1:{self.metrics_ports[process]}"\n'

    def start_daemon(self, timeout_s: float = 60.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.state_dir / "daemon.port"
        port_file.unlink(missing_ok=True)
        config = self.state_dir / "daemon.toml"
        config.write_text(
            f'listen = "127.0.0.1:{self.daemon_port}"\n'
            f'state_dir = "{self.state_dir / "daemon"}"\n'
            f'port_file = "{port_file}"\n'
            f"heartbeat_interval_s = {self.heartbeat_interval_s}\n"
            f"node_lost_after_s = {self.node_lost_after_s}\n"
            f"liveness_check_interval_s = {min(0.5, self.heartbeat_interval_s)}\n"
            + self._metrics_line("daemon")
            + self.daemon_extra
        )
        self.daemon_proc = self._spawn("fleetshift_daemon.main", config, "daemon")
        self.daemon_port = _wait_for(port_file, timeout_s, self.daemon_proc)
        self.wait_serving(timeout_s)

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.daemon_address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)  # type: ignore[attr-defined]
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"daemon not SERVING within {timeout_s}s")

    def start_agent(self, spec: NodeSpec, timeout_s: float = 60.0) -> None:
        port_file = self.state_dir / f"agent-{spec.name}.port"
        port_file.unlink(missing_ok=True)
        config = self.state_dir / f"agent-{spec.name}.toml"
        backoff_max = max(0.5, self.node_lost_after_s / 4)
        config.write_text(
            f'node_name = "{spec.name}"\n'
            'listen = "127.0.0.1:0"\n'
            f'daemon_address = "{self.daemon_address}"\n'
            f'state_dir = "{self.state_dir / ("agent-" + spec.name)}"\n'
            'inventory = "declared"\n'
            f'port_file = "{port_file}"\n'
            f"reconnect_max_s = {backoff_max}\n"
            + self._metrics_line(spec.name)
            + self.agent_extra
            + f'[[gpus]]\nproduct_name = "{spec.product_name}"\ncount = {spec.gpu_count}\n'
        )
        proc = self._spawn("fleetshift_agent.main", config, f"agent-{spec.name}")
        self.agent_procs[spec.name] = proc
        _wait_for(port_file, timeout_s, proc)

    def start(self, timeout_s: float = 60.0) -> None:
        self.start_daemon(timeout_s)
        for spec in self.nodes:
            self.start_agent(spec, timeout_s)
        self.wait_ready({s.name for s in self.nodes}, timeout_s)

    def list_nodes(self) -> list[pb.Node]:
        with grpc.insecure_channel(self.daemon_address) as ch:
            reply = pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5)
            return list(reply.nodes)

    def wait_state(self, names: set[str], state: int, timeout_s: float) -> list[pb.Node]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nodes = self.list_nodes()
                if names <= {n.name for n in nodes if n.state == state}:
                    return nodes
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(names)} not in state {state} in {timeout_s}s")
            time.sleep(0.1)

    def wait_ready(self, names: set[str], timeout_s: float) -> list[pb.Node]:
        return self.wait_state(names, pb.NODE_STATE_READY, timeout_s)

    def kill_daemon(self) -> None:
        _kill(self.daemon_proc, signal.SIGKILL)

    def kill_agent(self, name: str) -> None:
        _kill(self.agent_procs.pop(name, None), signal.SIGKILL)

    def stop(self, workers: bool = True) -> None:
        """SIGTERM everything (graceful stop), SIGKILL what has not exited after a grace.

        Workers outlive their agent by design (an agent restart must not kill them), so a
        local fleet that is done also ends the workers its agents recorded."""
        procs = [p for p in [*self.agent_procs.values(), self.daemon_proc] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(proc, signal.SIGKILL)
        self.agent_procs.clear()
        if workers:
            self._end_workers()

    def _end_workers(self) -> None:
        for record in self.state_dir.glob("agent-*/workers/*.json"):
            try:
                pid = int(json.loads(record.read_text())["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each worker leads its own process group


def _free_port() -> int:
    """A loopback port free right now (the process that binds it next is ours)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    proc.wait(timeout=10)
