"""A local fleet whose daemon is several replicas on one PostgreSQL database.

It is ``LocalFleet`` (real agent processes with declared GPUs) with the single daemon replaced
by ``count`` daemon processes on loopback ports chosen up front, so the agents' configuration
can list every replica (``daemon_address = "a,b,c"``) before any of them has started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import Engine

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_daemon.localfleet import LocalFleet, _free_port
from fleetshift_daemon.store.database import make_engine
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_rpc.replicas import sync_daemon_channel

TTL_S = 3.0
RENEW_S = 0.5
DEADLINE_S = 2.0


@dataclass
class ReplicaFleet(LocalFleet):
    database_url: str = ""
    count: int = 3
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    replica_env: dict[int, dict[str, str]] = field(default_factory=dict)  # failpoints per replica

    def __post_init__(self) -> None:
        self.ports = [_free_port() for _ in range(self.count)]

    @property
    def daemon_address(self) -> str:  # what agents and clients are given: every replica
        return ",".join(self.replica_address(i) for i in range(self.count))

    def replica_address(self, index: int) -> str:
        return f"127.0.0.1:{self.ports[index]}"

    def start_daemon(self, timeout_s: float = 60.0) -> None:
        for index in range(self.count):
            self.start_replica(index, timeout_s)

    def start_replica(self, index: int, timeout_s: float = 60.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / f"daemon-{index}.toml"
        config.write_text(
            f'listen = "{self.replica_address(index)}"\n'
            f'state_dir = "{self.state_dir / f"daemon-{index}"}"\n'
            f'database_url = "{self.database_url}"\n'
            f"heartbeat_interval_s = {self.heartbeat_interval_s}\n"
            f"node_lost_after_s = {self.node_lost_after_s}\n"
            f"liveness_check_interval_s = {min(0.5, self.heartbeat_interval_s)}\n"
            + self.daemon_extra
            + f"[replicas]\nlease_ttl_s = {TTL_S}\nrenew_interval_s = {RENEW_S}\n"
            f"renew_deadline_s = {DEADLINE_S}\nview_refresh_s = 0.2\n"
        )
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"daemon-{index}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.replica_env.get(index, {})}
        self.procs[index] = subprocess.Popen(
            [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._wait_serving(index, timeout_s)

    def _wait_serving(self, index: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.replica_address(index)) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                assert self.procs[index].poll() is None, f"daemon {index} exited"
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)  # type: ignore[attr-defined]
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"daemon {index} not SERVING within {timeout_s}s")

    def engine(self) -> Engine:
        return make_engine(self.database_url)

    def leader(self, timeout_s: float = 30.0) -> int:
        """The index of the replica that holds an unexpired lease now."""
        leases = SqlLeaseStore(self.engine())
        deadline = time.monotonic() + timeout_s
        while True:
            view = leases.current()
            for index in range(self.count):
                alive = index in self.procs and self.procs[index].poll() is None
                if alive and view.address == self.replica_address(index):
                    return index
            assert time.monotonic() < deadline, f"no live leader (lease: {view})"
            time.sleep(0.05)

    def kill_replica(self, index: int) -> None:
        proc = self.procs[index]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def list_nodes(self) -> list[pb.Node]:
        with sync_daemon_channel(self.daemon_address) as ch:
            reply = pb_grpc.FleetOperatorStub(ch).ListNodes(pb.ListNodesRequest(), timeout=5)
            return list(reply.nodes)

    def stop(self, workers: bool = True) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        super().stop(workers)


def replica_fleet(root: Path, model_dir: Path, database_url: str, **kw: object) -> ReplicaFleet:
    model = "small"
    return ReplicaFleet(
        root,
        heartbeat_interval_s=0.3,
        node_lost_after_s=5.0,
        daemon_extra=(
            "[planner]\ninterval_s = 0\n"
            f'[[models]]\nname = "{model}"\nhf_config = "{model_dir}"\nmodel_dir = "{model_dir}"\n'
            "tp_options = [1]\n"
        ),
        agent_extra="worker_compile = false\nworker_threads = 1\n",
        database_url=database_url,
        **kw,  # type: ignore[arg-type]
    )
