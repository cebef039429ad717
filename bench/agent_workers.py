"""What a move's agent steps cost: StartWorker (cold and warm), SnapshotWorker, FetchSnapshot,
StopWorker, next to the baseline of starting the same worker process by hand.

The ratio of StartWorker to a bare worker start is the agent's own overhead (validation,
records, spawning, waiting for the port file); the daemon's executor budgets each step from
these figures. Two agents with declared H100 inventories run in this process; no daemon is
needed (they serve while they retry registering).

    .venv/bin/python bench/agent_workers.py [--preset small] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_agent.app import Agent
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_common.config import AgentConfig, DeclaredGpu


def bare_start(model: Path, root: Path, threads: int) -> float:
    """The baseline: the worker process the agent would spawn, started by hand."""
    port_file = root / "bare.port"
    args = [
        sys.executable, "-m", "fleetshift_agent.worker", "--listen", "127.0.0.1:0",
        "--port-file", str(port_file), "--worker-id", "bare", "--no-compile",
        "--threads", str(threads), "--model-dir", str(model),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError("bare worker exited")
        time.sleep(0.01)
    took = time.monotonic() - started
    proc.terminate()
    proc.wait(30)
    return took


def config(name: str, root: Path, threads: int, nowhere: int) -> AgentConfig:
    return AgentConfig(
        node_name=name,
        listen="127.0.0.1:0",
        daemon_address=f"127.0.0.1:{nowhere}",
        state_dir=str(root / name),
        inventory="declared",
        gpus=(DeclaredGpu("NVIDIA H100 80GB HBM3", 2),),
        reconnect_max_s=5.0,
        worker_compile=False,
        worker_threads=threads,
    )


async def timed(what: str, call: object, figures: dict[str, float]) -> object:
    started = time.monotonic()
    reply = await call  # type: ignore[misc]
    figures[what] = time.monotonic() - started
    return reply


async def steps(model: Path, root: Path, threads: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = s.getsockname()[1]
    a, b = Agent(config("a", root, threads, nowhere)), Agent(config("b", root, threads, nowhere))
    await a.start()
    await b.start()
    f: dict[str, float] = {}
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as ca,
            grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as cb,
        ):
            sa, sb = agent_pb2_grpc.AgentServiceStub(ca), agent_pb2_grpc.AgentServiceStub(cb)
            start = agent_pb2.StartWorkerRequest(
                worker_id="src", model="m", model_dir=str(model), gpu_indices=[0],
                role=pb.WORKER_ROLE_MIXED,
            )  # fmt: skip
            await timed("start_cold_s", sa.StartWorker(start, timeout=600), f)
            snap = await timed(
                "snapshot_s",
                sa.SnapshotWorker(
                    agent_pb2.SnapshotWorkerRequest(worker_id="src", snapshot_id="s")
                ),
                f,
            )
            f["snapshot_pause_ms"] = snap.pause_ms  # type: ignore[attr-defined]
            f["snapshot_mb"] = snap.size_bytes / 1e6  # type: ignore[attr-defined]
            fetch = agent_pb2.FetchSnapshotRequest(
                source_agent_address=f"127.0.0.1:{a.port}", snapshot_id="s"
            )
            await timed("fetch_s", sb.FetchSnapshot(fetch), f)
            warm = agent_pb2.StartWorkerRequest(
                worker_id="dst", model="m", restore_snapshot_id="s", gpu_indices=[0],
                role=pb.WORKER_ROLE_MIXED,
            )  # fmt: skip
            await timed("start_warm_s", sb.StartWorker(warm, timeout=600), f)
            stop = agent_pb2.StopWorkerRequest(worker_id="src")
            await timed("stop_s", sa.StopWorker(stop), f)
            await sb.StopWorker(agent_pb2.StopWorkerRequest(worker_id="dst"))
    finally:
        await a.stop(0.1)
        await b.stop(0.1)
    return f


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "bench"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "model"
        make_model(["--out", str(model), "--preset", args.preset, "--seed", "1"])
        baseline = bare_start(model, root, args.threads)
        f = asyncio.run(steps(model, root, args.threads))
    print(f"preset={args.preset} threads={args.threads}")
    print(f"bare worker start (baseline)   {baseline:7.2f} s")
    print(f"StartWorker cold               {f['start_cold_s']:7.2f} s")
    print(f"  ratio to baseline            {f['start_cold_s'] / baseline:7.2f}x")
    print(f"SnapshotWorker                 {f['snapshot_s']:7.2f} s  ({f['snapshot_mb']:.1f} MB, "
          f"engine paused {f['snapshot_pause_ms']:.1f} ms)")  # fmt: skip
    print(f"FetchSnapshot                  {f['fetch_s']:7.2f} s  "
          f"({f['snapshot_mb'] / f['fetch_s']:.0f} MB/s)")  # fmt: skip
    print(f"StartWorker warm (snapshot)    {f['start_warm_s']:7.2f} s")
    print(f"  ratio to cold                {f['start_warm_s'] / f['start_cold_s']:7.2f}x")
    print(f"StopWorker                     {f['stop_s']:7.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
