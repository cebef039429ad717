"""Load: 1,000 simulated agents heartbeating at 1 Hz plus 2,000 Route calls/s, for minutes.

The daemon is a real process (SQLite under a temp dir, or a fresh PostgreSQL database); the
agents and the router are real gRPC clients in this process, each agent on its own 1 s
schedule with jitter. Reported: heartbeat RPC latency and the gap between a node's consecutive
heartbeats as they arrive (lag), Route latency, calls that failed, nodes the daemon ever
declared lost, and the daemon's CPU and RSS sampled every 5 s (RSS flat after warm-up is the
memory target).

    .venv/bin/python bench/load_heartbeats_routes.py --db sqlite --minutes 5
    .venv/bin/python bench/load_heartbeats_routes.py --db postgresql --minutes 5

Replicas (issue 17): ``--replicas 2`` starts two daemons on one fresh PostgreSQL database; each
agent registers with and heartbeats every replica (as an agent given the replica list does), and
the routers call Route on a channel listing every replica (round robin). ``--route-clients
unary,stream`` runs the load once per way of calling Route, one after the other on the same
daemons and fleet: ``unary`` one Route call per request (the baseline, what routers did
before), ``stream`` the same requests through ``fleetshift_rpc.route_stream.RouteClient``.

    PYTHONPATH=. .venv/bin/python bench/load_heartbeats_routes.py --replicas 2 --minutes 1 \
        --route-clients unary,stream

``--baseline`` first runs the same load against one daemon on its own fresh PostgreSQL
database (the same-run baseline for the replicas' figures).

``--mass-silence-fractions 1.0,0.5`` runs the whole load once per value of the daemons'
``mass_silence_fraction`` (1.0: the guard off, the same-run baseline; 0.5: the default), and
counts the times the daemons declared a mass silence (their logs) beside the nodes lost.

``--heartbeat-timeouts 1,5`` runs the whole load once per agents' heartbeat deadline (seconds):
1 s is what a real agent given several replicas used until 2026-12-05, 5 s what it uses now
(``fleetshift_agent.membership.RPC_TIMEOUT_S``). A heartbeat past its deadline is one the daemon
never hears.

``--heartbeat-clients unary,stream`` runs the whole load once per way the agents heartbeat:
``stream`` one HeartbeatStream call per agent and replica (``fleetshift_rpc.heartbeat_stream``,
what a real agent does since 2026-12-05; the default), ``unary`` one Heartbeat call per
heartbeat (what it did before: the same-run baseline).

Targets (issue 6): no heartbeat lost, Route p99 < 10 ms, RSS flat after warm-up; issue 17: the
same with two replicas. Baseline in the same run: the first minute's RSS against the last
minute's (growth ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_rpc.heartbeat_stream import HeartbeatSender
from fleetshift_rpc.replicas import aio_daemon_channel
from fleetshift_rpc.route_stream import route_client

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


PROBE_DIR = Path(__file__).parent / "loop_probe"


def start_daemon(
    tmp: Path, url: str, probe: str = "", src: str = "", mass_silence: float | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """``mass_silence`` None: the key is left out (a ``--before-src`` tree may not know it)."""
    config = tmp / "daemon.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{tmp}"\nport_file = "{tmp / "port"}"\n'
        f'database_url = "{url}"\n'
        "heartbeat_interval_s = 1\nnode_lost_after_s = 10\nrate_limit_per_s = 1e9\n"
        "rate_limit_burst = 1000000000\n"
        + (f"mass_silence_fraction = {mass_silence}\n" if mass_silence is not None else "")
        + "[planner]\ninterval_s = 30\n"
        '[[models]]\nname = "llama-70b"\npreset = "llama2-70b"\ntp_options = [4, 8]\n'
    )
    env = dict(os.environ)
    if src:  # a daemon from another source tree (``--before-src``)
        root = Path(src).resolve()
        env["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("daemon", "common", "proto"))
    if probe:  # event-loop lag and GC pauses inside the daemon (bench/loop_probe)
        path = os.pathsep.join(p for p in (str(PROBE_DIR), env.get("PYTHONPATH", "")) if p)
        env.update(PYTHONPATH=path, FLEETSHIFT_PROBE_OUT=probe)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "daemon.log", "wb"),  # noqa: SIM115
        env=env,
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
    def __init__(
        self,
        address: str,
        nodes: int,
        routes_per_s: float,
        seconds: float,
        route_client: str = "unary",
        split: bool = False,
        heartbeat_timeout_s: float = 5.0,
        heartbeat_client: str = "stream",
    ) -> None:
        self.address, self.nodes, self.routes_per_s, self.seconds = (
            address,
            nodes,
            routes_per_s,
            seconds,
        )
        self.addresses = address.split(",")  # every replica: agents heartbeat each
        self.route_client = route_client
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_client = heartbeat_client
        # True: the agents' heartbeats come from a process of their own, so the Route client's
        # event loop and core share are its own (the same load, a separate load generator).
        self.split = split
        self.route_events: list[tuple[float, float]] = []  # (wall time sent, latency s)
        self.client_lags: list[tuple[float, float]] = []  # the Route client's own loop
        self.client_ticks = 0
        self.agents_cores = 0.0  # the agents' process, when split
        self.window = (0.0, 0.0)  # wall time of the measured run
        self.hb_latency: list[float] = []
        self.hb_gaps: list[float] = []
        self.route_latency: list[float] = []
        self.failures: dict[str, int] = {"heartbeat": 0, "route": 0}
        self.lost_seen: set[str] = set()
        self.lost_checks = 0
        self.client_cpu0 = 0.0
        self.client_cores = 0.0  # the load generator's own CPU (it shares the cores)

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
        sender = HeartbeatSender(ch)
        beat = (
            sender.send
            if self.heartbeat_client == "stream"
            else lambda r, timeout: stub.Heartbeat(r, timeout=timeout)
        )
        request = fpb.HeartbeatRequest(node_name=f"node-{n:04d}", workers=statuses(n))
        await asyncio.sleep(random.random())
        last = None
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                await beat(request, timeout=self.heartbeat_timeout_s)
                self.hb_latency.append(time.perf_counter() - t0)
                if last is not None:
                    self.hb_gaps.append(t0 - last)
                last = t0
            except grpc.aio.AioRpcError:
                self.failures["heartbeat"] += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))

    async def router(self, ch: grpc.aio.Channel, end: float, k: int, streams: int) -> None:
        stub = pb_grpc.PlacementStub(ch)
        route = route_client(ch).route if self.route_client == "stream" else stub.Route
        interval = streams / self.routes_per_s
        rng = random.Random(k)
        next_at = time.perf_counter() + rng.random() * interval
        while time.perf_counter() < end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            next_at += interval
            t0 = time.perf_counter()
            try:
                await route(
                    pb.RouteRequest(model="llama-70b", prompt_tokens=rng.randint(50, 4000)),
                    timeout=5,
                )
                took = time.perf_counter() - t0
                self.route_latency.append(took)
                self.route_events.append((time.time() - took, took))
            except grpc.aio.AioRpcError:
                self.failures["route"] += 1

    async def lag_probe(self, end: float) -> None:
        """How late this process's event loop wakes a 5 ms sleep (as bench/loop_probe does
        inside the daemons): a late wake delays every Route reply this loop reads."""
        while time.perf_counter() < end:
            asked = time.perf_counter()
            await asyncio.sleep(0.005)
            late = time.perf_counter() - asked - 0.005
            self.client_ticks += 1
            if late > 0.002:
                self.client_lags.append((time.time(), late))

    async def agents_only(self, end: float) -> None:
        """The heartbeat half of the load alone (``--agents-only``, the split mode's child)."""
        per_replica = [[grpc.aio.insecure_channel(a) for _ in range(8)] for a in self.addresses]
        await asyncio.gather(
            *(
                self.agent(channels[n % 8], n, end)
                for channels in per_replica
                for n in range(self.nodes)
            )
        )
        for ch in (c for channels in per_replica for c in channels):
            await ch.close()

    def spawn_agents(self, out: Path) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, __file__, "--agents-only", str(out), "--address", self.address,
            "--nodes", str(self.nodes), "--minutes", str(self.seconds / 60),
            "--heartbeat-timeouts", str(self.heartbeat_timeout_s),
            "--heartbeat-clients", self.heartbeat_client,
        ]  # fmt: skip
        return subprocess.Popen(cmd)

    def merge_agents(self, out: Path) -> None:
        data = json.loads(out.read_text())
        self.hb_latency, self.hb_gaps = data["hb_latency"], data["hb_gaps"]
        self.failures["heartbeat"] = data["failed"]
        self.agents_cores = data["cores"]

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

    async def run(
        self, pids: list[int], registered: bool = False
    ) -> list[tuple[float, float, int]]:
        """The load for ``seconds``; samples are (time, CPU seconds, RSS) summed over
        ``pids`` (the replicas)."""
        samples: list[tuple[float, float, int]] = []
        per_replica = [[grpc.aio.insecure_channel(a) for _ in range(8)] for a in self.addresses]
        routers = [aio_daemon_channel(self.address) for _ in range(8)]
        if not registered:
            t0 = time.perf_counter()
            for channels in per_replica:
                await self.register(channels[0])
            print(
                f"registered {self.nodes} nodes with {len(per_replica)} replica(s) in "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        start = time.perf_counter()
        self.client_cpu0 = time.process_time()
        end = start + self.seconds

        async def sample() -> None:
            while time.perf_counter() < end:
                stats = [proc_stats(pid) for pid in pids]
                samples.append(
                    (
                        time.perf_counter() - start,
                        sum(c for c, _ in stats),
                        sum(r for _, r in stats),
                    )
                )
                await asyncio.sleep(5)

        streams = 64
        agents_out = Path(tempfile.mkdtemp()) / "agents.json"
        child = self.spawn_agents(agents_out) if self.split else None
        await asyncio.gather(
            sample(),
            self.lag_probe(end),
            self.watch_lost(per_replica[0][0], end),
            *(
                self.agent(channels[n % 8], n, end)
                for channels in ([] if self.split else per_replica)
                for n in range(self.nodes)
            ),
            *(self.router(routers[k % 8], end, k, streams) for k in range(streams)),
        )
        self.client_cores = (time.process_time() - self.client_cpu0) / (time.perf_counter() - start)
        self.window = (time.time() - (time.perf_counter() - start), time.time())
        if child is not None:
            child.wait(timeout=120)
            self.merge_agents(agents_out)
        for ch in [*routers, *(c for channels in per_replica for c in channels)]:
            await ch.close()
        return samples


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q)) if values else float("nan")


def start_replicas(
    tmp: Path,
    url: str,
    count: int,
    probe: bool = False,
    src: str = "",
    mass_silence: float | None = None,
) -> list[tuple[subprocess.Popen[bytes], int]]:
    """``count`` daemons on one database (PostgreSQL for more than one)."""
    started = []
    for i in range(count):
        home = tmp / f"replica-{i}"
        home.mkdir()
        probe_out = str(home / "probe") if probe else ""
        started.append(start_daemon(home, url, probe_out, src, mass_silence))
    return started


def mass_silences(tmp: Path) -> int:
    """How many times the replicas' silence guard started sparing nodes (their logs)."""
    return sum(
        log.read_text(errors="replace").count("suspecting this daemon")
        for log in tmp.glob("replica-*/daemon.log")
    )


def in_window(events: list[Any], window: tuple[float, float]) -> list[Any]:
    return [e for e in events if window[0] <= e[0] <= window[1]]


def lag_line(name: str, lags: list[tuple[float, float]], ticks: int, seconds: float) -> str:
    late = [x for _, x in lags]
    over = [sum(x > limit for x in late) for limit in (0.010, 0.050, 0.100)]
    return (
        f"  {name}: "
        + (f"{ticks:,} wakes; " if ticks else "")
        + f"late > 10 / 50 / 100 ms: {over[0]} / {over[1]} / {over[2]}; "
        f"max {1e3 * max(late, default=0):.0f} ms; stalled {sum(late):.2f} s of {seconds:.0f} s"
    )


def overlapping(
    routes: list[tuple[float, float]], stalls: list[tuple[float, float]], min_stall: float
) -> int:
    """Routes whose flight [sent, sent + latency] overlaps a stall [woke - late, woke]."""
    spans = sorted((woke - late, woke) for woke, late in stalls if late >= min_stall)
    starts = [a for a, _ in spans]
    count = 0
    for sent, took in routes:
        i = bisect.bisect_left(starts, sent + took)  # stalls that began before the reply
        count += any(b > sent for _, b in spans[max(0, i - 50) : i])
    return count


def probe_report(load: Load, pids: list[int], tmp: Path) -> None:
    """Where the Route tail sits: the client's loop, each daemon's loop, GC pauses."""
    window = load.window
    seconds = window[1] - window[0]
    routes = in_window(load.route_events, window)
    if not routes:
        return
    cut = float(np.percentile([t for _, t in routes], 99))
    slow = [r for r in routes if r[1] >= cut]
    print(f"tail probe: {len(slow)} Routes at or over p99 ({1e3 * cut:.1f} ms)")
    client = in_window(load.client_lags, window)
    print(lag_line("load generator's loop", client, load.client_ticks, seconds))
    daemon_stalls: list[tuple[float, float]] = []
    print(
        f"  load generator CPU {load.client_cores:.2f} cores"
        + (f", agents' process {load.agents_cores:.2f} cores" if load.split else "")
    )
    for i, pid in enumerate(pids):
        path = tmp / f"replica-{i}" / f"probe.{pid}.json"
        if not path.exists():
            print(f"  replica {i}: no probe file")
            continue
        data = json.loads(path.read_text())
        lags = in_window([tuple(x) for x in data["lags"]], window)
        gcs = in_window([tuple(x) for x in data["gcs"]], window)
        print(lag_line(f"replica {i} loop", lags, 0, seconds))
        by_gen = {g: [d for _, gen, d in gcs if gen == g] for g in (0, 1, 2)}
        print(
            "  replica "
            + f"{i} GC: "
            + "; ".join(
                f"gen{g} {len(d)} runs, max {1e3 * max(d, default=0):.1f} ms, total {sum(d):.2f} s"
                for g, d in by_gen.items()
            )
        )
        daemon_stalls += lags
        overlap_gc = overlapping(slow, [(t, d) for t, _, d in gcs], 0.005)
        print(f"  replica {i}: slow Routes overlapping one of its GC pauses >= 5 ms: {overlap_gc}")
    for limit in (0.010, 0.050):
        c = overlapping(slow, client, limit)
        d = overlapping(slow, daemon_stalls, limit)
        print(
            f"  slow Routes overlapping a stall >= {1e3 * limit:.0f} ms: load generator's loop "
            f"{c} ({100 * c / len(slow):.0f} %), a daemon's loop {d} ({100 * d / len(slow):.0f} %)"
        )


def report(load: Load, samples: list[tuple[float, float, int]], args: argparse.Namespace) -> None:
    seconds = args.minutes * 60
    cpu = (
        (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])
        if len(samples) > 1
        else 0
    )
    first = [rss for t, _, rss in samples if t <= 60]
    last = [rss for t, _, rss in samples if t >= samples[-1][0] - 60]
    print(
        f"db={args.db} replicas={args.replicas} route client={load.route_client} "
        f"nodes={args.nodes} minutes={args.minutes} routes/s target={args.routes_per_s}"
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
        f"daemon CPU (all replicas): {cpu:.2f} cores; RSS first minute max {max(first) / 2**20:.0f} MiB, last minute max {max(last) / 2**20:.0f} MiB (growth x{max(last) / max(first):.3f})"
    )
    print(f"load generator CPU: {load.client_cores:.2f} cores")
    print(f"load average now: {os.getloadavg()[0]:.1f}", flush=True)


def run_setup(
    args: argparse.Namespace,
    replicas_count: int,
    db: str,
    modes: list[str],
    src: str = "",
    mass_silence: float | None = None,
    heartbeat_timeout_s: float = 5.0,
    heartbeat_client: str = "stream",
) -> None:
    """Start ``replicas_count`` daemons on a fresh database, run the load once per Route
    client mode, report, and tear everything down."""
    args.replicas, args.db = replicas_count, db
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        url, db_name = make_database(db, tmp)
        replicas = start_replicas(tmp, url, replicas_count, args.probe, src, mass_silence)
        print(
            f"=== daemons from {src or 'this tree'}, mass_silence_fraction "
            f"{'(their default)' if mass_silence is None else mass_silence}, "
            f"agents' heartbeat timeout {heartbeat_timeout_s:g} s, heartbeats {heartbeat_client}",
            flush=True,
        )
        address = ",".join(f"127.0.0.1:{port}" for _, port in replicas)
        pids = [proc.pid for proc, _ in replicas]
        try:
            for i, mode in enumerate(modes):
                split = mode.endswith("-split")
                client = mode.removesuffix("-split")
                load = Load(
                    address,
                    args.nodes,
                    args.routes_per_s,
                    args.minutes * 60,
                    client,
                    split,
                    heartbeat_timeout_s,
                    heartbeat_client,
                )
                samples = asyncio.run(load.run(pids, registered=i > 0))
                print(f"--- mode {mode}" + (" (agents in a process of their own)" if split else ""))
                report(load, samples, args)
                print(f"mass silences the daemons declared (so far): {mass_silences(tmp)}")
                if args.probe:
                    probe_report(load, pids, tmp)
        finally:
            for proc, _ in replicas:
                proc.terminate()
                proc.wait(timeout=60)
            drop_database(db_name)


def agents_only(args: argparse.Namespace) -> None:
    """The split mode's child: heartbeat every replica for ``--minutes``, write the figures."""
    timeout_s = float(args.heartbeat_timeouts.split(",")[0])
    load = Load(
        args.address,
        args.nodes,
        0.0,
        args.minutes * 60,
        heartbeat_timeout_s=timeout_s,
        heartbeat_client=args.heartbeat_clients.split(",")[0],
    )
    cpu0, start = time.process_time(), time.perf_counter()
    asyncio.run(load.agents_only(start + load.seconds))
    cores = (time.process_time() - cpu0) / (time.perf_counter() - start)
    figures = {"hb_latency": load.hb_latency, "hb_gaps": load.hb_gaps}
    figures |= {"failed": load.failures["heartbeat"], "cores": cores}
    args.agents_only.write_text(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--routes-per-s", type=float, default=2000.0)
    parser.add_argument("--replicas", type=int, default=1, help="more than 1: PostgreSQL")
    parser.add_argument(
        "--route-clients",
        default="unary",
        help="unary (baseline), stream; a -split suffix (stream-split) runs the agents' "
        "heartbeats from a process of their own instead of the Route client's",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="record event-loop lag and GC pauses in each daemon (bench/loop_probe) and in the "
        "load generator, and which slow Routes overlap them",
    )
    parser.add_argument(
        "--before-src",
        default="",
        help="first the same load against daemons run from this source tree (`git archive "
        "main daemon common proto | tar -x -C DIR`): a change's before and after in one run",
    )
    parser.add_argument(
        "--mass-silence-fractions",
        default="0.5",
        help="the daemons' mass_silence_fraction, a run each: 1.0 turns the guard off "
        "(e.g. 1.0,0.5: the guard's same-run baseline first)",
    )
    parser.add_argument(
        "--heartbeat-timeouts",
        default="5",
        help="the agents' heartbeat deadline in seconds, a run each (e.g. 1,5: the 1 s cap a "
        "real agent with replicas used before, then today's 5 s)",
    )
    parser.add_argument(
        "--heartbeat-clients",
        default="stream",
        help="how the agents heartbeat, a run each: stream (HeartbeatStream, what agents do), "
        "unary (one call per heartbeat, the baseline before 2026-12-05); e.g. unary,stream",
    )
    parser.add_argument("--agents-only", type=Path, help=argparse.SUPPRESS)  # split mode child
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="first the same load against one daemon on its own fresh PostgreSQL database "
        "(the same-run baseline for --replicas N)",
    )
    args = parser.parse_args()
    if args.replicas > 1:
        args.db = "postgresql"
    if args.agents_only:
        agents_only(args)
        return
    modes = args.route_clients.split(",")
    known = {"unary", "stream", "unary-split", "stream-split"}
    if set(modes) - known:
        parser.error(f"--route-clients: unknown {sorted(set(modes) - known)}")
    if set(args.heartbeat_clients.split(",")) - {"unary", "stream"}:
        parser.error("--heartbeat-clients: unary and/or stream")
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    replicas, db = args.replicas, args.db
    if args.baseline:
        run_setup(args, 1, "postgresql", modes)
    if args.before_src:
        run_setup(args, replicas, db, modes, args.before_src)
    for client in args.heartbeat_clients.split(","):
        for timeout_s in (float(t) for t in args.heartbeat_timeouts.split(",")):
            for fraction in (float(f) for f in args.mass_silence_fractions.split(",")):
                run_setup(
                    args,
                    replicas,
                    db,
                    modes,
                    mass_silence=fraction,
                    heartbeat_timeout_s=timeout_s,
                    heartbeat_client=client,
                )


if __name__ == "__main__":
    main()
