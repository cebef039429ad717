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
from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeRecord,
    NodeState,
    NodeVersions,
)
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec
from fleetshift_daemon.localfleet import LocalFleet, _free_port
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.lease_store import SqlLeaseStore
from fleetshift_daemon.store.registry_store import SqlRegistryStore
from fleetshift_daemon.store.work_store import SqlWorkerStore
from fleetshift_rpc.replicas import sync_daemon_channel
from fleetshift_rpc.security import client_credentials

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
    # Where replica i listens (default 127.0.0.1; 127.0.0.0/8 is all loopback on Linux, so
    # replicas can have addresses of their own, as on several hosts).
    hosts: list[str] = field(default_factory=list)
    # mTLS: replica i serves with pki_dir/daemon-<replica_cert_name(i)>.crt, issued by the test.
    replica_pki: Path | None = None

    def replica_cert_name(self, index: int) -> str:
        return f"replica{index}"

    def __post_init__(self) -> None:
        self.ports = [_free_port() for _ in range(self.count)]

    @property
    def daemon_address(self) -> str:  # what agents and clients are given: every replica
        return ",".join(self.replica_address(i) for i in range(self.count))

    def replica_address(self, index: int) -> str:
        host = self.hosts[index] if self.hosts else "127.0.0.1"
        return f"{host}:{self.ports[index]}"

    def _replica_tls(self, index: int) -> str:
        if self.replica_pki is None:
            return ""
        stem = self.replica_pki / f"daemon-{self.replica_cert_name(index)}"
        return (
            f'tls_cert = "{stem}.crt"\ntls_key = "{stem}.key"\n'
            f'tls_ca = "{self.replica_pki / "ca.crt"}"\n'
        )

    def _health_channel(self, index: int) -> grpc.Channel:
        if self.replica_pki is None:
            return grpc.insecure_channel(self.replica_address(index))
        stem = self.replica_pki / f"daemon-{self.replica_cert_name(index)}"
        creds = client_credentials(
            str(self.replica_pki / "ca.crt"), cert=f"{stem}.crt", key=f"{stem}.key"
        )
        return grpc.secure_channel(self.replica_address(index), creds)

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
            + self._replica_tls(index)
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
        with self._health_channel(index) as ch:
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


SEEDED_MODEL = "m70"


def seeded_fleet(root: Path, database_url: str, **kw: object) -> ReplicaFleet:
    """Replicas that find a fleet in the database when they start, as after a restart: node
    n1 (4 H100s) ready and worker w1 serving SEEDED_MODEL on it. No agent or engine process:
    Route only picks a worker, it never calls it, so Route and the read APIs work."""
    fleet = ReplicaFleet(
        root,
        nodes=(),
        heartbeat_interval_s=1.0,
        node_lost_after_s=600.0,  # no agent heartbeats here: the node must stay ready
        daemon_extra=(
            "[planner]\ninterval_s = 0\n"
            f'[[models]]\nname = "{SEEDED_MODEL}"\npreset = "llama2-70b"\ntp_options = [4]\n'
        ),
        database_url=database_url,
        **kw,  # type: ignore[arg-type]
    )
    engine = fleet.engine()
    upgrade(engine)
    now = time.time()
    gpus = tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 << 30, "hbm3", "9.0") for i in range(4))
    SqlRegistryStore(engine).save_node(
        NodeRecord(
            "n1", "127.0.0.1:9", NodeState.READY, InventorySource.DECLARED, NodeVersions(),
            gpus, registered_at=now, last_heartbeat_at=now,
        )
    )  # fmt: skip
    SqlWorkerStore(engine).save_worker(
        WorkerRecord(
            "w1", "n1", WorkerSpec(SEEDED_MODEL, Role.MIXED, tp=4), (0, 1, 2, 3), "127.0.0.1:9",
            WorkerState.SERVING, now,
        )
    )  # fmt: skip
    engine.dispose()
    return fleet
