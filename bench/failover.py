"""Daemon failover: from SIGKILL to the next Route served and to the new leader's first action.

Replicas: three ``fleetshiftd`` processes on one fresh PostgreSQL database; a synthetic fleet
(N nodes with two workers each, registered and heartbeating through the real agent protocol
to every replica, as a real agent given the replica list does); a Route prober on a channel
that lists every replica, one call every 10 ms. The leader is SIGKILLed. Measured:

- kill -> first Route answered afterwards, the longest gap between answers, refusals;
- kill -> lease taken by a follower (the lease row's ``renewed_at``, database clock);
- kill -> the new leader's first action: its first liveness sweep, seen as the first
  heartbeat time later than the kill written to the database (only the leader's sweep writes
  them, and the killed leader can write nothing after the kill).

Baseline, same run: the single daemon on SQLite as shipped, SIGKILLed and restarted at once
(as ``Restart=always`` would): kill -> first Route answered, and kill -> ready again.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/failover.py --nodes 100 --rounds 3

Targets (issue 17): first action < lease TTL + 1 s; first Route by a follower < 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg
from sqlalchemy import func, select

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_daemon.localfleet import _free_port
from fleetshift_daemon.store.database import make_engine
from fleetshift_daemon.store.models import LeaderLeaseRow, NodeRow
from fleetshift_rpc.replicas import aio_daemon_channel

GiB = 1024**3
PG_ADMIN = os.environ.get("FLEETSHIFT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
TTL_S, RENEW_S, DEADLINE_S = 3.0, 0.5, 2.0


def daemon_config(tmp: Path, name: str, port: int, database_url: str) -> Path:
    config = tmp / f"{name}.toml"
    db = f'database_url = "{database_url}"\n' if database_url else ""
    config.write_text(
        f'listen = "127.0.0.1:{port}"\nstate_dir = "{tmp / name}"\n{db}'
        "heartbeat_interval_s = 0.5\nnode_lost_after_s = 30\nliveness_check_interval_s = 0.1\n"
        "rate_limit_per_s = 1e9\nrate_limit_burst = 1000000000\n"
        "[planner]\ninterval_s = 0\n"
        '[[models]]\nname = "llama-70b"\npreset = "llama2-70b"\ntp_options = [4, 8]\n'
        f"[replicas]\nlease_ttl_s = {TTL_S}\nrenew_interval_s = {RENEW_S}\n"
        f"renew_deadline_s = {DEADLINE_S}\nview_refresh_s = 0.2\n"
    )
    return config


def spawn(config: Path) -> subprocess.Popen[bytes]:
    """The daemon's log goes beside its config (shown when a round fails)."""
    with config.with_suffix(".log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def log_tails(tmp: Path, lines: int = 15) -> str:
    return "\n".join(
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        for log in sorted(tmp.glob("*.log"))
    )


def node_messages(n: int) -> tuple[fpb.RegisterNodeRequest, fpb.HeartbeatRequest]:
    name = f"node-{n:04d}"
    gpus = [fpb.Gpu(index=i, product_name="NVIDIA H100 80GB HBM3", memory_bytes=80 * GiB)
            for i in range(8)]  # fmt: skip
    workers = [
        fpb.WorkerStatus(
            worker_id=f"{name}-w{k}", model="llama-70b", role=fpb.WORKER_ROLE_MIXED,
            tensor_parallel=4, gpu_indices=list(range(4 * k, 4 * k + 4)),
            endpoint=f"10.0.{n // 250}.{n % 250}:{9000 + k}", state=fpb.WORKER_STATE_SERVING,
            counters=fpb.WorkerCounters(worker_id=f"{name}-w{k}", kv_blocks_total=50_000),
        )
        for k in range(2)
    ]  # fmt: skip
    reg = fpb.RegisterNodeRequest(node_name=name, agent_address="127.0.0.1:1", gpus=gpus)
    return reg, fpb.HeartbeatRequest(node_name=name, workers=workers)


@dataclass
class Agents:
    """The synthetic fleet: registers with and heartbeats to every address it is given."""

    addresses: list[str]
    nodes: int
    refused: dict[str, int] = field(default_factory=dict)

    async def register(self) -> None:
        for address in self.addresses:
            await self.register_at(address)

    async def register_at(self, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = fpb_grpc.AgentRegistryStub(ch)
            for n in range(self.nodes):
                reg, beat = node_messages(n)
                await stub.RegisterNode(reg, timeout=10)
                await stub.Heartbeat(beat, timeout=10)

    async def beat_forever(self, address: str, interval_s: float = 0.5) -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = fpb_grpc.AgentRegistryStub(ch)
            while True:
                for n in range(self.nodes):
                    try:
                        await stub.Heartbeat(node_messages(n)[1], timeout=1)
                    except grpc.aio.AioRpcError:
                        self.refused[address] = self.refused.get(address, 0) + 1
                await asyncio.sleep(interval_s)


@dataclass
class Prober:
    address: str
    served: list[tuple[float, float]] = field(default_factory=list)  # (sent, answered)
    refused: int = 0

    async def run(self) -> None:
        async with aio_daemon_channel(self.address) as ch:
            route = pb_grpc.PlacementStub(ch).Route
            request = pb.RouteRequest(
                model="llama-70b", prompt_tokens=500, expected_output_tokens=200
            )
            while True:
                sent = time.time()
                try:
                    await route(request, timeout=2)
                    self.served.append((sent, time.time()))
                except grpc.aio.AioRpcError:
                    self.refused += 1
                await asyncio.sleep(0.01)

    def answered_since(self, t: float) -> bool:
        return any(sent > t for sent, _ in self.served)

    def after(self, t: float) -> float:
        """Kill -> the answer to the first call sent after it (so surely not a reply the dead
        process wrote before it died)."""
        return next(done for sent, done in self.served if sent > t) - t

    def longest_gap(self, t: float) -> float:
        times = [done for sent, done in self.served if t - 2 < sent < t + 30]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def wait_until(check, timeout_s: float = 120.0, step: float = 0.005) -> float:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(check)  # database reads must not stall the prober
        if value:
            return float(value)
        await asyncio.sleep(step)
    raise TimeoutError("condition not reached")


async def wait_serving(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        route = pb_grpc.PlacementStub(ch).Route
        request = pb.RouteRequest(model="llama-70b", prompt_tokens=500, expected_output_tokens=200)
        last = "none"
        for _ in range(2400):
            try:
                await route(request, timeout=1)
                return
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details()}"
                await asyncio.sleep(0.05)
    raise TimeoutError(f"{address} never served Route (last answer {last})")


async def baseline_round(tmp: Path, nodes: int) -> dict[str, float]:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    config = daemon_config(tmp, f"single-{uuid.uuid4().hex[:6]}", port, "")
    proc = spawn(config)
    agents = Agents([address], nodes)
    try:
        await wait_serving_after_start(address, agents)
        prober = Prober(address)
        tasks = [
            asyncio.create_task(prober.run()),
            asyncio.create_task(agents.beat_forever(address)),
        ]
        await asyncio.sleep(2.0)
        killed = time.time()
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        proc = spawn(config)  # restarted at once, as Restart=always would
        await wait_until(lambda: prober.answered_since(killed))
        route_after = prober.after(killed)
        for task in tasks:
            task.cancel()
        return {"route_s": route_after, "refused": prober.refused, "action_s": route_after}
    finally:
        proc.kill()
        proc.wait()


async def register_after_start(address: str, agents: Agents) -> None:
    for _ in range(1200):
        try:
            await agents.register_at(address)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)


async def wait_serving_after_start(address: str, agents: Agents) -> None:
    await register_after_start(address, agents)
    await wait_serving(address)


async def replica_round(tmp: Path, nodes: int) -> dict[str, float]:
    name = f"fleetshift_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"
    ports = [_free_port() for _ in range(3)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for i, port in enumerate(ports):
            procs.append(spawn(daemon_config(tmp, f"replica-{name}-{i}", port, url)))
        agents = Agents(addresses, nodes)
        # Every replica hears the fleet before any is asked to route: a follower learns a
        # worker only once the leader adopted it from its own heartbeat and wrote it, and
        # whichever replica wins the lease, it need not be the first one started.
        for address in addresses:
            await register_after_start(address, agents)
        for address in addresses:
            await wait_serving(address)
        engine = make_engine(url)

        def lease() -> tuple[str, int]:
            with engine.connect() as conn:
                row = conn.execute(select(LeaderLeaseRow.address, LeaderLeaseRow.token)).one()
            return str(row[0]), int(row[1])

        leader_address, token = lease()
        prober = Prober(",".join(addresses))
        tasks = [asyncio.create_task(prober.run())]
        tasks += [asyncio.create_task(agents.beat_forever(a)) for a in addresses]
        await asyncio.sleep(3.0)
        leader = procs[addresses.index(leader_address)]
        killed = time.time()
        leader.send_signal(signal.SIGKILL)
        await asyncio.to_thread(leader.wait)

        def new_lease_at() -> float:
            with engine.connect() as conn:
                row = conn.execute(select(LeaderLeaseRow.token, LeaderLeaseRow.renewed_at)).one()
            return row[1].timestamp() if row[0] > token else 0.0

        def first_sweep_at() -> float:
            with engine.connect() as conn:
                latest = conn.execute(select(func.max(NodeRow.last_heartbeat_at))).scalar_one()
            return latest.timestamp() if latest and latest.timestamp() > killed else 0.0

        elected = await wait_until(new_lease_at, step=0.01)
        await wait_until(first_sweep_at, step=0.01)
        acted = time.time()  # first seen; the heartbeat time itself is earlier (received)
        await asyncio.sleep(1.0)
        for task in tasks:
            task.cancel()
        engine.dispose()
        live = [a for a in addresses if a != leader_address]
        return {
            "route_s": prober.after(killed),
            "gap_s": prober.longest_gap(killed),
            "refused": prober.refused,
            "elected_s": elected - killed,
            "action_s": acted - killed,
            "beats_refused_live": sum(agents.refused.get(a, 0) for a in live),
        }
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            try:
                base = asyncio.run(baseline_round(Path(tmp), args.nodes))
                rep = asyncio.run(replica_round(Path(tmp), args.nodes))
            except TimeoutError:
                print(log_tails(Path(tmp)), file=sys.stderr)
                raise
            rows.append((r, base, rep))
            print(f"round {r}: baseline {base}\n         replicas {rep}", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}; lease TTL {TTL_S} s, renew {RENEW_S} s, "
          f"deadline {DEADLINE_S} s; {args.nodes} nodes, Route every 10 ms")  # fmt: skip
    print("| round | single daemon: kill -> Route served again (s) | replicas: kill -> Route "
          "(ms) | longest Route gap (ms) | Route refused | kill -> lease taken (s) | kill -> "
          "first leader action (s) | heartbeats refused by live replicas |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r, base, rep in rows:
        print(
            f"| {r} | {base['route_s']:.2f} | {rep['route_s'] * 1000:.0f} | "
            f"{rep['gap_s'] * 1000:.0f} | {rep['refused']:.0f} | {rep['elected_s']:.2f} | "
            f"{rep['action_s']:.2f} | {rep['beats_refused_live']:.0f} |"
        )


if __name__ == "__main__":
    main()
