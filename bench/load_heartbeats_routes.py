"""Load: 1,000 simulated agents heartbeating at 1 Hz plus 2,000 Route calls/s, for minutes.

The daemon is a real process (SQLite under a temp dir, or a fresh PostgreSQL database); the
agents and the router are real gRPC clients in this process, each agent on its own 1 s
schedule with jitter. Reported: heartbeat RPC latency and the gap between a node's consecutive
heartbeats as they arrive (lag), Route latency, calls that failed, nodes the daemon ever
declared lost, and the daemon's CPU and RSS sampled every 5 s (RSS flat after warm-up is the
memory target).

    .venv/bin/python bench/load_heartbeats_routes.py --db sqlite --minutes 5
    .venv/bin/python bench/load_heartbeats_routes.py --db postgresql --minutes 5

Targets (issue 6): no heartbeat lost, Route p99 < 10 ms, RSS flat after warm-up.
Baseline in the same run: the first minute's RSS against the last minute's (growth ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import numpy as np

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc

GiB = 1024**3
PRODUCTS = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200"]
ROLES = [fpb.WORKER_ROLE_PREFILL, fpb.WORKER_ROLE_DECODE, fpb.WORKER_ROLE_MIXED]
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


def make_database(kind: str, tmp: Path) -> tuple[str, str]:
    if kind == "sqlite":
        return f"sqlite:///{tmp / 'fleet.db'}", ""
    import psycopg

    name = f"fleetshift_load_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return PG_ADMIN.rsplit("/", 1)[0] + f"/{name}", name


def drop_database(name: str) -> None:
    if name:
        import psycopg

        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_daemon(tmp: Path, url: str) -> tuple[subprocess.Popen[bytes], int]:
    config = tmp / "daemon.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{tmp}"\nport_file = "{tmp / "port"}"\n'
        f'database_url = "{url}"\n'
        "heartbeat_interval_s = 1\nnode_lost_after_s = 10\nrate_limit_per_s = 1e9\n"
        "rate_limit_burst = 1000000000\n"
        "[planner]\ninterval_s = 30\n"
        '[[models]]\nname = "llama-70b"\npreset = "llama2-70b"\ntp_options = [4, 8]\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "daemon.log", "wb"),  # noqa: SIM115
    )
    for _ in range(1200):
        port_file = tmp / "port"
        if port_file.exists() and port_file.read_text().strip():
            return proc, int(port_file.read_text())
        time.sleep(0.05)
    raise TimeoutError("daemon did not start")


def proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds so far, RSS bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def statuses(n: int) -> list[fpb.WorkerStatus]:
    name = f"node-{n:04d}"
    return [
        fpb.WorkerStatus(
            worker_id=f"{name}-w{k}",
            model="llama-70b",
            role=ROLES[(n + k) % 3],
            tensor_parallel=4,
            gpu_indices=list(range(4 * k, 4 * k + 4)),
            endpoint=f"127.0.0.1:{20000 + 2 * n + k}",
            state=fpb.WORKER_STATE_SERVING,
            counters=fpb.WorkerCounters(
                worker_id=f"{name}-w{k}", kv_blocks_total=50_000, live_sessions=k
            ),
        )
        for k in range(2)
    ]


class Load:
    def __init__(self, address: str, nodes: int, routes_per_s: float, seconds: float) -> None:
        self.address, self.nodes, self.routes_per_s, self.seconds = (
            address,
            nodes,
            routes_per_s,
            seconds,
        )
        self.hb_latency: list[float] = []
        self.hb_gaps: list[float] = []
        self.route_latency: list[float] = []
        self.failures: dict[str, int] = {"heartbeat": 0, "route": 0}
        self.lost_seen: set[str] = set()
        self.lost_checks = 0

    async def register(self, ch: grpc.aio.Channel) -> None:
        agents = fpb_grpc.AgentRegistryStub(ch)
        for n in range(self.nodes):
            gpus = [
                fpb.Gpu(index=i, product_name=PRODUCTS[n % 3], memory_bytes=80 * GiB)
                for i in range(8)
            ]
            await agents.RegisterNode(
                fpb.RegisterNodeRequest(
                    node_name=f"node-{n:04d}", agent_address="127.0.0.1:1", gpus=gpus
                )
            )
            await agents.Heartbeat(
                fpb.HeartbeatRequest(node_name=f"node-{n:04d}", workers=statuses(n))
            )

    async def agent(self, ch: grpc.aio.Channel, n: int, end: float) -> None:
        stub = fpb_grpc.AgentRegistryStub(ch)
        request = fpb.HeartbeatRequest(node_name=f"node-{n:04d}", workers=statuses(n))
        await asyncio.sleep(random.random())
        last = None
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                await stub.Heartbeat(request, timeout=5)
                self.hb_latency.append(time.perf_counter() - t0)
                if last is not None:
                    self.hb_gaps.append(t0 - last)
                last = t0
            except grpc.aio.AioRpcError:
                self.failures["heartbeat"] += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))

    async def router(self, ch: grpc.aio.Channel, end: float, k: int, streams: int) -> None:
        stub = pb_grpc.PlacementStub(ch)
        interval = streams / self.routes_per_s
        rng = random.Random(k)
        next_at = time.perf_counter() + rng.random() * interval
        while time.perf_counter() < end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            next_at += interval
            t0 = time.perf_counter()
            try:
                await stub.Route(
                    pb.RouteRequest(model="llama-70b", prompt_tokens=rng.randint(50, 4000)),
                    timeout=5,
                )
                self.route_latency.append(time.perf_counter() - t0)
            except grpc.aio.AioRpcError:
                self.failures["route"] += 1

    async def watch_lost(self, ch: grpc.aio.Channel, end: float) -> None:
        """Nodes the daemon declares lost once every agent heartbeats (registering 1,000 nodes
        one by one takes longer than the lost timeout, so the first ones go lost meanwhile)."""
        stub = fpb_grpc.FleetOperatorStub(ch)
        await asyncio.sleep(12)  # node_lost_after_s (10) + one heartbeat
        while time.perf_counter() < end:
            lost = await stub.ListNodes(fpb.ListNodesRequest(state=fpb.NODE_STATE_LOST))
            self.lost_seen |= {n.name for n in lost.nodes}
            self.lost_checks += 1
            await asyncio.sleep(2)

    async def run(self, pid: int) -> list[tuple[float, float, int]]:
        samples: list[tuple[float, float, int]] = []
        channels = [grpc.aio.insecure_channel(self.address) for _ in range(8)]
        await self.register(channels[0])
        start = time.perf_counter()
        end = start + self.seconds

        async def sample() -> None:
            while time.perf_counter() < end:
                cpu, rss = proc_stats(pid)
                samples.append((time.perf_counter() - start, cpu, rss))
                await asyncio.sleep(5)

        streams = 64
        await asyncio.gather(
            sample(),
            self.watch_lost(channels[0], end),
            *(self.agent(channels[n % 8], n, end) for n in range(self.nodes)),
            *(self.router(channels[k % 8], end, k, streams) for k in range(streams)),
        )
        for ch in channels:
            await ch.close()
        return samples


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--routes-per-s", type=float, default=2000.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        url, db_name = make_database(args.db, tmp)
        proc, port = start_daemon(tmp, url)
        try:
            load = Load(f"127.0.0.1:{port}", args.nodes, args.routes_per_s, args.minutes * 60)
            samples = asyncio.run(load.run(proc.pid))
        finally:
            proc.terminate()
            proc.wait()
            drop_database(db_name)
    seconds = args.minutes * 60
    cpu = (
        (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])
        if len(samples) > 1
        else 0
    )
    first = [rss for t, _, rss in samples if t <= 60]
    last = [rss for t, _, rss in samples if t >= samples[-1][0] - 60]
    print(
        f"db={args.db} nodes={args.nodes} minutes={args.minutes} routes/s target={args.routes_per_s}"
    )
    print(
        f"heartbeats ok {len(load.hb_latency):,} ({len(load.hb_latency) / seconds:,.0f}/s), failed {load.failures['heartbeat']}"
    )
    print(
        f"heartbeat RPC p50/p99 ms: {pct(load.hb_latency, 50):.2f} / {pct(load.hb_latency, 99):.2f}"
    )
    print(
        f"heartbeat gap (lag) p50/p99 s: {np.percentile(load.hb_gaps, 50):.3f} / {np.percentile(load.hb_gaps, 99):.3f}"
    )
    print(
        f"routes ok {len(load.route_latency):,} ({len(load.route_latency) / seconds:,.0f}/s), failed {load.failures['route']}"
    )
    print(
        f"route p50/p99 ms: {pct(load.route_latency, 50):.2f} / {pct(load.route_latency, 99):.2f}"
    )
    print(f"nodes lost after the warm-up (checked {load.lost_checks} times): {len(load.lost_seen)}")
    print(
        f"daemon CPU: {cpu:.2f} cores; RSS first minute max {max(first) / 2**20:.0f} MiB, last minute max {max(last) / 2**20:.0f} MiB (growth x{max(last) / max(first):.3f})"
    )


if __name__ == "__main__":
    main()
