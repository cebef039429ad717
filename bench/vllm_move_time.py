"""Whole-worker move time for vLLM workers: warm where possible vs cold, against a fresh start.

A local fleet of real processes (daemon, agents on declared H100, H100 and H200 nodes,
vLLM's CPU build behind FleetShift's vLLM worker; the tiny tests/vllm model, float32, eager,
one thread, FleetShift's disk KV connector). The baseline, in the same run: StartWorker of
the same worker, fresh (what a move without FleetShift costs at least, and it loses the
sessions). Then, with ``--sessions`` greedy sessions streaming to clients that follow them
through the daemon:

- H100 -> H100 ("warm where possible"): the same GPU model, where a reference worker would
  be restored from a snapshot. vLLM has no snapshot on this machine (CRIU and
  cuda-checkpoint are absent), so the daemon plans a cold start and the sessions' KV goes
  through the connector (the step's ``sessions_kv_restored``, from vLLM's own counter).
- H100 -> H200 (cold): another GPU model; the compatibility key refuses the KV, the target
  recomputes each session from its token history.

Per move: total time until the source is retired, when each phase was reached, sessions
carried and KV-restored, the daemon's longest session pause and the longest gap a client saw.

    nice -n 10 .venv/bin/python bench/vllm_move_time.py [--sessions 3] [--prompt 300]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_fleet import (
    KV_MODEL,
    deadline,
    machine_load,
    make_vllm_model,
    move,
    start_worker,
    vllm_fleet,
)
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import worker_pb2
from fleetshift_daemon.localfleet import NodeSpec
from fleetshift_rpc.sessions import follow_session

NODES = (
    NodeSpec("h100-a", "NVIDIA H100 80GB HBM3", 1),
    NodeSpec("h100-b", "NVIDIA H100 80GB HBM3", 1),
    NodeSpec("h200-a", "NVIDIA H200", 1),
)
MOVES = (("same GPU model (warm where possible)", "h100-b"), ("other GPU model (cold)", "h200-a"))


async def client(
    daemon: grpc.aio.Channel, endpoint: str, i: int, args: argparse.Namespace, stamps: list[float]
) -> None:
    rng = random.Random(i)
    request = worker_pb2.GenerateRequest(
        prompt_tokens=[rng.randrange(3, 500) for _ in range(args.prompt)],
        max_new_tokens=args.tokens,
        sampling=worker_pb2.WorkerSampling(temperature=0.0),
        session_id=f"move-{i}",
    )
    async for _ in follow_session(daemon, endpoint, request):
        stamps.append(time.monotonic())


def largest_gap(stamps: list[list[float]], start: float, end: float) -> float:
    gaps = [b - a for s in stamps for a, b in itertools.pairwise(s) if b >= start and a <= end]
    return max(gaps, default=float("nan"))


async def run(fleet, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    rows = []
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        t0 = time.perf_counter()
        worker = await start_worker(ops, "h100-a", KV_MODEL)
        fresh = time.perf_counter() - t0
        print(f"fresh start (baseline): {fresh:.1f} s", flush=True)
        stamps: list[list[float]] = [[] for _ in range(args.sessions)]
        clients = [
            asyncio.create_task(client(daemon, worker.endpoint, i, args, stamps[i]))
            for i in range(args.sessions)
        ]
        while min(len(s) for s in stamps) < 10:
            for task in clients:
                if task.done():
                    task.result()
            await asyncio.sleep(0.1)
        source = worker.worker_id
        for name, target in MOVES:
            start = time.monotonic()
            op, phases, total = await move(ops, source, target)
            end = time.monotonic()
            if op.state != pb.OPERATION_STATE_SUCCEEDED:
                raise RuntimeError(f"{name}: {op}")
            (step,) = op.steps
            if step.sessions_carried != args.sessions:
                raise RuntimeError(f"{name} carried {step.sessions_carried}: raise --tokens")
            counts = [len(s) for s in stamps]
            while any(len(s) < c + 5 for s, c in zip(stamps, counts, strict=True)):
                if any(t.done() for t in clients):
                    raise RuntimeError("a session ended during the bench: raise --tokens")
                await asyncio.sleep(0.1)  # every client streams on after the move
            rows.append((name, target, op, step, phases, total, largest_gap(stamps, start, end)))
            print(f"{name}: {total:.1f} s", flush=True)
            source = step.new_worker_id
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    report(fresh, rows, args)


def report(fresh: float, rows: list, args: argparse.Namespace) -> None:  # type: ignore[type-arg]
    print(f"\nload at the end: {machine_load()}")
    print(f"{args.sessions} live sessions of {args.prompt}-token prompts per move")
    print(
        "| move | step kind | seconds | sessions carried | KV restored | daemon's max pause (ms) "
        "| largest client gap (ms) | phases reached (s from MoveWorker) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(f"| fresh start (baseline) | StartWorker | {fresh:.1f} | 0 (lost) | - | - | - | - |")
    for name, target, _op, step, phases, total, gap in rows:
        kind = pb.StepKind.Name(step.kind).removeprefix("STEP_KIND_").lower()
        timeline = ", ".join(f"{p} {t:.1f}" for p, t in phases.items())
        print(
            f"| {name} -> {target} | {kind} | {total:.1f} | {step.sessions_carried} | "
            f"{step.sessions_kv_restored} | {step.max_session_pause_ms:.0f} | {gap * 1000:.0f} | "
            f"{timeline} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--prompt", type=int, default=300, help="each session's prompt (tokens)")
    p.add_argument(
        "--tokens", type=int, default=16000, help="each session's length (outlasts both moves)"
    )
    p.add_argument("--timeout-s", type=float, default=2400, help="the whole bench's deadline")
    args = p.parse_args()
    deadline(args.timeout_s)
    print(f"load before: {machine_load()}", flush=True)
    window = args.prompt + args.tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_vllm_model(root / "model", window)
        fleet = vllm_fleet(root / "fleet", model, NODES, window)
        try:
            fleet.start(timeout_s=180)
            asyncio.run(run(fleet, args))
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
