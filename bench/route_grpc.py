"""Route throughput and latency over real gRPC, against a fleet of 1,000 nodes.

The daemon runs in its own process pinned to one core (the target is per core); the fleet is
registered through the real agent protocol (1,000 nodes of 8 declared GPUs, two workers each);
the load comes from another process with a real grpc.aio client keeping N calls in flight.
Baseline, same run, same daemon, same client: the standard health Check call, i.e. what a
unary gRPC call costs before any routing happens; and unary Route, what routers did before
RouteStream. Then the same Route requests through ``fleetshift_rpc.route_stream.RouteClient``
(many requests on one RouteStream call), which skips gRPC's per-call cost.

    .venv/bin/python bench/route_grpc.py --seconds 10 --concurrency 32

``--before-src DIR`` also starts a daemon from another source tree (``git archive main daemon
common proto | tar -x -C DIR``) on the same core, with the same fleet, and alternates the
RouteStream load between it and this tree's daemon in ``--rounds`` slices: a change's before
and after in the same run, at the same load.

``--profile FILE`` runs the daemon under cProfile (its stats written to FILE at exit) to see
where Route's time goes; figures measured with it on are not comparable to those without.

Targets (issue 4): >= 5,000 Route calls/s on one core, p99 < 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_rpc.route_stream import RouteClient

GiB = 1024**3
PRODUCTS = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200"]
ROLES = [fpb.WORKER_ROLE_PREFILL, fpb.WORKER_ROLE_DECODE, fpb.WORKER_ROLE_MIXED]


def start_daemon(
    tmp: Path, core: int, profile: str = "", src: str = ""
) -> tuple[subprocess.Popen[bytes], int]:
    tmp.mkdir(exist_ok=True)
    config = tmp / "daemon.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\nstate_dir = "{tmp}"\nport_file = "{tmp / "port"}"\n'
        "heartbeat_interval_s = 30\nnode_lost_after_s = 600\nrate_limit_per_s = 1e9\n"
        "rate_limit_burst = 1000000000\n"
        "[planner]\ninterval_s = 0\n"
        '[[models]]\nname = "llama-70b"\npreset = "llama2-70b"\ntp_options = [4, 8]\n'
    )
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(core),
            sys.executable,
            *(["-m", "cProfile", "-o", profile] if profile else []),
            "-m",
            "fleetshift_daemon.main",
            "--config",
            str(config),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=source_env(src),
    )
    for _ in range(600):
        port_file = tmp / "port"
        if port_file.exists() and port_file.read_text().strip():
            return proc, int(port_file.read_text())
        time.sleep(0.05)
    raise TimeoutError("daemon did not start")


def source_env(src: str) -> dict[str, str] | None:
    """The environment of a daemon run from the source tree ``src`` ("": this one)."""
    if not src:
        return None
    root = Path(src).resolve()
    paths = [str(root / d) for d in ("daemon", "common", "proto")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


async def register_fleet(address: str, nodes: int) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        for n in range(nodes):
            name = f"node-{n:04d}"
            product = PRODUCTS[n % 3]
            gpus = [fpb.Gpu(index=i, product_name=product, memory_bytes=80 * GiB) for i in range(8)]
            await agents.RegisterNode(
                fpb.RegisterNodeRequest(node_name=name, agent_address="127.0.0.1:1", gpus=gpus)
            )
            workers = [
                fpb.WorkerStatus(
                    worker_id=f"{name}-w{k}",
                    model="llama-70b",
                    role=ROLES[(n + k) % 3],
                    tensor_parallel=4,
                    gpu_indices=list(range(4 * k, 4 * k + 4)),
                    endpoint=f"10.0.{n // 250}.{n % 250}:{9000 + k}",
                    state=fpb.WORKER_STATE_SERVING,
                    counters=fpb.WorkerCounters(worker_id=f"{name}-w{k}", kv_blocks_total=50_000),
                )
                for k in range(2)
            ]
            await agents.Heartbeat(fpb.HeartbeatRequest(node_name=name, workers=workers))


async def load(address: str, seconds: float, concurrency: int, call: str) -> tuple[int, np.ndarray]:
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address) as ch:
        route = pb_grpc.PlacementStub(ch).Route
        check = health_pb2_grpc.HealthStub(ch).Check
        stream = RouteClient(ch)
        if call == "stream":
            route = stream.route  # type: ignore[assignment]
        rng = np.random.default_rng(1)
        prompts = rng.integers(50, 4000, 100_000)
        outputs = rng.integers(10, 1500, 100_000)
        deadline = time.perf_counter() + seconds

        async def client(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                if call != "health":
                    await route(
                        pb.RouteRequest(
                            model="llama-70b",
                            prompt_tokens=int(prompts[i % 100_000]),
                            expected_output_tokens=int(outputs[i % 100_000]),
                        )
                    )
                else:
                    await check(health_pb2.HealthCheckRequest())
                latencies.append(time.perf_counter() - t0)
                i += concurrency

        start = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
        await stream.close()
    return int(len(latencies) / elapsed), np.array(latencies) * 1000


def report(name: str, rate: int, lat: np.ndarray) -> str:
    p50, p99 = np.percentile(lat, [50, 99])
    return f"| {name} | {rate:,} | {p50:.2f} | {p99:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--profile", default="", help="cProfile the daemon into this file")
    parser.add_argument("--before-src", default="", help="also run a daemon from this tree")
    parser.add_argument("--rounds", type=int, default=4, help="slices per daemon (--before-src)")
    args = parser.parse_args()
    if args.before_src:
        before_after(args)
        return
    cores = sorted(os.sched_getaffinity(0))
    daemon_core, client_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {client_core})
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_daemon(Path(tmp), daemon_core, args.profile)
        address = f"127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            asyncio.run(register_fleet(address, args.nodes))
            took = time.perf_counter() - t0
            print(f"registered {args.nodes} nodes, {2 * args.nodes} workers in {took:.1f} s")
            asyncio.run(load(address, 2.0, args.concurrency, "route"))  # warm-up
            base_rate, base_lat = asyncio.run(
                load(address, args.seconds, args.concurrency, "health")
            )
            rate, lat = asyncio.run(load(address, args.seconds, args.concurrency, "route"))
            asyncio.run(load(address, 2.0, args.concurrency, "stream"))  # warm-up
            s_rate, s_lat = asyncio.run(load(address, args.seconds, args.concurrency, "stream"))
        finally:
            proc.send_signal(signal.SIGTERM)  # a clean exit: cProfile writes its stats then
            proc.wait(timeout=60)
    print(
        f"daemon on core {daemon_core}, client on core {client_core}, {args.concurrency} in flight"
    )
    print("| call | calls/s | p50 ms | p99 ms |\n|---|---|---|---|")
    print(report("Health/Check (baseline)", base_rate, base_lat))
    print(report("Placement/Route (unary, before)", rate, lat))
    print(report("Placement/RouteStream via RouteClient", s_rate, s_lat))
    print(f"unary Route throughput / baseline: {rate / base_rate:.2f}")
    print(f"RouteStream throughput / baseline: {s_rate / base_rate:.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


def before_after(args: argparse.Namespace) -> None:
    """RouteStream on the daemon of ``--before-src`` and on this tree's, alternated."""
    cores = sorted(os.sched_getaffinity(0))
    daemon_core, client_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {client_core})
    slice_s = args.seconds / args.rounds
    rates: dict[str, list[int]] = {"before": [], "after": []}
    lats: dict[str, list[np.ndarray]] = {"before": [], "after": []}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        try:
            for name, src in (("before", args.before_src), ("after", "")):
                procs[name] = start_daemon(Path(tmp) / name, daemon_core, src=src)
            for _proc, port in procs.values():
                asyncio.run(register_fleet(f"127.0.0.1:{port}", args.nodes))
                asyncio.run(load(f"127.0.0.1:{port}", 2.0, args.concurrency, "stream"))  # warm
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    address = f"127.0.0.1:{procs[name][1]}"
                    rate, lat = asyncio.run(load(address, slice_s, args.concurrency, "stream"))
                    rates[name].append(rate)
                    lats[name].append(lat)
                loads.append(os.getloadavg()[0])
        finally:
            for proc, _ in procs.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    print(
        f"daemons on core {daemon_core} (one at a time under load), client on core "
        f"{client_core}, {args.concurrency} in flight, {args.rounds} alternated slices of "
        f"{slice_s:.1f} s each"
    )
    print("| daemon | RouteStream calls/s (mean of slices) | p50 ms | p99 ms |\n|---|---|---|---|")
    for name, label in (("before", f"before ({args.before_src})"), ("after", "after (this tree)")):
        rate = int(sum(rates[name]) / len(rates[name]))
        print(report(label, rate, np.concatenate(lats[name])) + f" slices {rates[name]}")
    ratio = sum(rates["after"]) / sum(rates["before"])
    print(f"after / before throughput: {ratio:.2f}")
    print(
        "load average (1 min) at start and after each round: " + " ".join(f"{x:.1f}" for x in loads)
    )


if __name__ == "__main__":
    main()
