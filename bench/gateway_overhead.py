"""What the OpenAI gateway adds: TTFT and tokens/s through it against the same worker called
directly over gRPC, in the same run.

A local fleet (a daemon, one agent with a declared H100, one reference-engine worker of a
locally made model) and a gateway process. Each round sends one request straight to the
worker's Generate and one through the gateway (raw SSE over HTTP with httpx, so the
openai SDK's own parsing is not charged to the gateway), alternating so both see the same
machine load. Through the gateway a request also pays its Route call, its prompt's
tokenizing and its detokenizing: that is the overhead being measured.

    nice -n 10 .venv/bin/python bench/gateway_overhead.py --preset tiny --rounds 30

Targets (issue 15): <= 2 ms added to TTFT at p50, <= 3 % fewer tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import numpy as np

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from tests.gateway.procs import gateway

MODEL = "bench-model"


async def direct(stub: worker_pb2_grpc.WorkerServiceStub, prompt: list[int], n: int, i: int):  # type: ignore[no-untyped-def]
    req = worker_pb2.GenerateRequest(
        prompt_tokens=prompt,
        max_new_tokens=n,
        sampling=worker_pb2.WorkerSampling(temperature=0.0),
        session_id=f"direct-{i}",
    )
    start, first, count = time.perf_counter(), 0.0, 0
    async for _ in stub.Generate(req):
        count += 1
        first = first or time.perf_counter()
    return first - start, count / (time.perf_counter() - first) if count > 1 else 0.0


async def through(client: httpx.AsyncClient, url: str, prompt: list[int], n: int):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    start, first, count = time.perf_counter(), 0.0, 0
    async with client.stream("POST", url + "/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            json.loads(line[6:])
            count += 1
            first = first or time.perf_counter()
    return first - start, count / (time.perf_counter() - first) if count > 1 else 0.0


async def measure(fleet: LocalFleet, url: str, args: argparse.Namespace) -> None:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        worker = await pb_grpc.OperationsStub(daemon).StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name="n1"),
            timeout=300,
        )
    prompt = [(7 * i) % 200 + 1 for i in range(args.prompt_tokens)]
    rows: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
    async with (
        grpc.aio.insecure_channel(worker.endpoint) as ch,
        httpx.AsyncClient(timeout=300) as client,
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for i in range(args.warmup + args.rounds):
            d = await direct(stub, prompt, args.max_tokens, i)
            g = await through(client, url, prompt, args.max_tokens)
            if i >= args.warmup:
                rows["direct"].append(d)
                rows["gateway"].append(g)
    report(rows, args)


def report(rows: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    print(
        f"preset={args.preset} rounds={args.rounds} prompt={args.prompt_tokens} "
        f"max_tokens={args.max_tokens} (sequential, one request in flight)"
    )
    print(f"{'path':<10}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'tok/s p50':>11}")
    stats = {}
    for path, values in rows.items():
        ttft = np.array([v[0] for v in values]) * 1e3
        rate = np.array([v[1] for v in values])
        stats[path] = (np.median(ttft), np.percentile(ttft, 90), np.median(rate))
        print(f"{path:<10}{stats[path][0]:>13.2f}{stats[path][1]:>13.2f}{stats[path][2]:>11.1f}")
    added = stats["gateway"][0] - stats["direct"][0]
    paired = np.median([g[0] - d[0] for g, d in zip(rows["gateway"], rows["direct"], strict=True)])
    loss = 1 - stats["gateway"][2] / stats["direct"][2]
    print(
        f"added TTFT p50: {added:.2f} ms (paired per round: {paired * 1e3:.2f} ms); target <= 2 ms"
    )
    print(f"tokens/s lost: {loss * 100:.1f} %; target <= 3 %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = root / "model"
        assert make_model(["--out", str(model_dir), "--preset", args.preset]) == 0
        fleet = LocalFleet(
            root / "fleet",
            (NodeSpec("n1", "NVIDIA H100 80GB HBM3", 1),),
            heartbeat_interval_s=0.5,
            daemon_extra=(
                "[planner]\ninterval_s = 0\n"
                f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\n'
                f'model_dir = "{model_dir}"\ntp_options = [1]\n'
            ),
            agent_extra="worker_compile = false\nworker_threads = 1\n",
        )
        try:
            fleet.start(timeout_s=120)
            with gateway(root / "gw", fleet.daemon_address, MODEL, model_dir) as url:
                asyncio.run(measure(fleet, url, args))
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
