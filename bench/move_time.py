"""Whole-worker move time: warm (same GPU model) against cold (another GPU model).

A local fleet of real processes on this CPU (declared H100, H100, H200 nodes), one worker of
the benchmark-size reference model (`bench` preset, ~1.4 GB float32) with a few live sessions.
The worker is moved H100 -> H100 (snapshot, transfer, warm restore, sessions with their KV)
and then H100 -> H200 (cold start from the model directory, sessions as token history).
Reported per move: total time until the source is retired, the time of each phase, bytes
moved, sessions carried and the longest session pause. Baseline in the same run: starting the
same worker fresh (StartWorker), which is what a move without FleetShift costs at least (plus
the sessions it loses).

    .venv/bin/python bench/move_time.py --preset bench
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_agent.engine.make_model import main as make_model
from tests.e2e.conftest import make_fleet


async def stream(endpoint: str, i: int, live: asyncio.Event, count: list[int]) -> None:
    """One long session, read until the move ends its stream here."""
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        request = worker_pb2.GenerateRequest(prompt_tokens=[1 + i] * 200, max_new_tokens=1500)
        try:
            async for _ in stub.Generate(request):
                count[0] += 1
                live.set()
        except grpc.aio.AioRpcError:
            pass  # ABORTED "moved": the session continues on the target


async def run(fleet, sessions: int) -> None:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        ops = pb_grpc.OperationsStub(ch)
        t0 = time.perf_counter()
        worker = await ops.StartWorker(
            pb.StartFleetWorkerRequest(
                model="small", role=fpb.WORKER_ROLE_MIXED, node_name="h100-a"
            ),
            timeout=900,
        )
        fresh = time.perf_counter() - t0
        print(f"| fresh start (baseline) | {fresh:.1f} | | | |")
        for target in ("h100-b", "h200-a"):
            live, count = asyncio.Event(), [0]
            streams = [
                asyncio.create_task(stream(worker.endpoint, i, live, count))
                for i in range(sessions)
            ]
            await live.wait()
            t0 = time.perf_counter()
            op = await ops.MoveWorker(
                pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target), timeout=60
            )
            phases: dict[str, float] = {}
            async for update in ops.WatchOperation(
                pb.WatchOperationRequest(operation_id=op.id), timeout=1800
            ):
                op = update
                phases.setdefault(op.steps[0].phase, time.perf_counter() - t0)
            total = time.perf_counter() - t0
            for task in streams:
                task.cancel()
            step = op.steps[0]
            kind = pb.StepKind.Name(step.kind).removeprefix("STEP_KIND_").lower()
            timeline = ", ".join(f"{p} {t:.1f}s" for p, t in phases.items())
            print(
                f"| {kind} -> {target} | {total:.1f} | {step.bytes_moved / 1e9:.2f} | {step.sessions_carried} | "
                f"{step.max_session_pause_ms:.0f} |  ({pb.OperationState.Name(op.state)}; {timeline})"
            )
            workers = await ppb_grpc.PlanningStub(ch).ListWorkers(ppb.ListWorkersRequest())
            worker = next(w for w in workers.workers if w.worker_id == step.new_worker_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    parser.add_argument("--sessions", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model"
        make_model(["--out", str(model), "--preset", args.preset, "--seed", "3"])
        size = sum(f.stat().st_size for f in model.iterdir()) / 1e9
        fleet = make_fleet(tmp / "fleet", model)
        fleet.start(timeout_s=300)
        print(
            f"model preset {args.preset}: {size:.2f} GB of weights; {args.sessions} live sessions per move"
        )
        print(
            "| move | seconds | GB moved | sessions | max session pause ms |\n|---|---|---|---|---|"
        )
        try:
            asyncio.run(run(fleet, args.sessions))
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
