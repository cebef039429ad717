"""The pause a client sees when its session moves: the largest gap between two tokens.

Why: the executor's ``max_session_pause_ms`` and the phase timings are measured inside the
daemon; what a user feels is the gap in the token stream of a client that follows its session
across the move, through the daemon's ``LocateSession`` (``fleetshift_rpc.sessions``:
``routed_session`` routes it through ``Placement/Route`` and re-attaches after the move's
ABORTED "moved"). This bench runs exactly that client against a local fleet of real processes
(daemon, agents, reference-engine workers on this CPU, the ``small`` model), moves the worker
warm (H100 -> H100) and then cold (H100 -> H200) while the sessions stream, and reports per
move the largest gap any client saw during the move, beside the daemon's own figures (the
step's pause, the snapshot phase durations from the daemon's /metrics). Baseline in the same
run: the gaps between tokens of the same clients outside the moves (median and largest).

    nice -n 10 .venv/bin/python bench/client_pause.py [--sessions 4] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from fleetshift_rpc.sessions import routed_session

MODEL = "small"
NODES = (
    NodeSpec("h100-a", "NVIDIA H100 80GB HBM3", 1),
    NodeSpec("h100-b", "NVIDIA H100 80GB HBM3", 1),
    NodeSpec("h200-a", "NVIDIA H200", 1),
)
MOVES = (("warm H100 -> H100", "h100-b"), ("cold H100 -> H200", "h200-a"))


def phase_sums(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        s.labels["phase"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "fleetshift_snapshot_duration_seconds_sum"
    }


async def run(fleet: LocalFleet, sessions: int, tokens: int) -> None:
    stamps: dict[int, list[float]] = {i: [] for i in range(sessions)}
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await ops.StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name="h100-a"),
            timeout=300,
        )

        async def client(i: int) -> None:
            prompt = [(7 * i + k) % 200 + 1 for k in range(16)]
            route = ppb.RouteRequest(model=MODEL, prompt_tokens=len(prompt))
            request = worker_pb2.GenerateRequest(
                prompt_tokens=prompt,
                max_new_tokens=tokens,
                sampling=worker_pb2.WorkerSampling(temperature=0.0),
                session_id=f"bench-{i}",
            )
            async for _ in routed_session(daemon, route, request):
                stamps[i].append(time.monotonic())

        clients = asyncio.gather(*(client(i) for i in range(sessions)))
        while min(len(s) for s in stamps.values()) < 50:
            await asyncio.sleep(0.05)
        windows = []
        source = worker.worker_id
        for name, target in MOVES:
            await asyncio.sleep(2.0)  # a stretch of undisturbed stream between moves
            before = phase_sums(fleet.metrics_ports["daemon"])
            started = time.monotonic()
            op = await ops.MoveWorker(
                pb.MoveWorkerRequest(worker_id=source, target_node=target), timeout=30
            )
            async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
                op = update
            ended = time.monotonic()
            after = phase_sums(fleet.metrics_ports["daemon"])
            phases = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k)}
            step = op.steps[0]
            assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
            windows.append((name, started, ended, step, phases))
            source = step.new_worker_id
        await clients
    assert all(len(s) == tokens for s in stamps.values()), "a client lost tokens"
    report(stamps, windows)


def report(stamps: dict[int, list[float]], windows: list) -> None:  # type: ignore[type-arg]
    inside: dict[str, list[float]] = {name: [] for name, *_ in windows}
    outside: list[float] = []
    for times in stamps.values():
        for a, b in itertools.pairwise(times):
            for name, start, end, *_ in windows:
                if b >= start and a <= end:
                    inside[name].append(b - a)
                    break
            else:
                outside.append(b - a)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (2 cores shared)")
    print(
        f"baseline (same clients, outside the moves): median gap "
        f"{statistics.median(outside) * 1000:.1f} ms, largest {max(outside) * 1000:.1f} ms"
    )
    print("| move | largest client gap (ms) | step pause (ms, daemon) | phases (daemon, s) |")
    print("|---|---|---|---|")
    for name, start, end, step, phases in windows:
        shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items())) or "-"
        print(
            f"| {name} | {max(inside[name]) * 1000:.0f} | {step.max_session_pause_ms:.0f} | "
            f"{shown}; move total {end - start:.1f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = root / "model"
        assert make_model(["--out", str(model_dir), "--preset", MODEL, "--seed", "3"]) == 0
        fleet = LocalFleet(
            root / "fleet",
            NODES,
            heartbeat_interval_s=0.3,
            metrics=True,
            daemon_extra=(
                "[planner]\ninterval_s = 0\n"
                f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\n'
                f'model_dir = "{model_dir}"\ntp_options = [1]\n'
            ),
            agent_extra="worker_compile = false\nworker_threads = 1\n",
        )
        try:
            fleet.start(timeout_s=180)
            asyncio.run(run(fleet, args.sessions, args.tokens))
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
