"""Route throughput and latency over real gRPC, against a fleet of 1,000 nodes.

The daemon runs in its own process pinned to one core (the target is per core); the fleet is
registered through the real agent protocol (1,000 nodes of 8 declared GPUs, two workers each);
the load comes from another process with a real grpc.aio client keeping N calls in flight.
Baseline, same run, same daemon, same client: the standard health Check call, i.e. what a
unary gRPC call costs before any routing happens.

    .venv/bin/python bench/route_grpc.py --seconds 10 --concurrency 32

Targets (issue 4): >= 5,000 Route calls/s on one core, p99 < 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

GiB = 1024**3
PRODUCTS = ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200"]
ROLES = [fpb.WORKER_ROLE_PREFILL, fpb.WORKER_ROLE_DECODE, fpb.WORKER_ROLE_MIXED]


def start_daemon(tmp: Path, core: int) -> tuple[subprocess.Popen[bytes], int]:
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
            "-m",
            "fleetshift_daemon.main",
            "--config",
            str(config),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        port_file = tmp / "port"
        if port_file.exists() and port_file.read_text().strip():
            return proc, int(port_file.read_text())
        time.sleep(0.05)
    raise TimeoutError("daemon did not start")


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
        rng = np.random.default_rng(1)
        prompts = rng.integers(50, 4000, 100_000)
        outputs = rng.integers(10, 1500, 100_000)
        deadline = time.perf_counter() + seconds

        async def client(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                if call == "route":
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
    return int(len(latencies) / elapsed), np.array(latencies) * 1000


def report(name: str, rate: int, lat: np.ndarray) -> str:
    p50, p99 = np.percentile(lat, [50, 99])
    return f"| {name} | {rate:,} | {p50:.2f} | {p99:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    daemon_core, client_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {client_core})
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_daemon(Path(tmp), daemon_core)
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
        finally:
            proc.terminate()
            proc.wait()
    print(
        f"daemon on core {daemon_core}, client on core {client_core}, {args.concurrency} in flight"
    )
    print("| call | calls/s | p50 ms | p99 ms |\n|---|---|---|---|")
    print(report("Health/Check (baseline)", base_rate, base_lat))
    print(report("Placement/Route", rate, lat))
    print(f"Route throughput / baseline: {rate / base_rate:.2f}")


if __name__ == "__main__":
    main()
