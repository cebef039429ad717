"""What the OpenAI gateway adds: TTFT and tokens/s through it against the same worker called
directly over gRPC, in the same run.

A local fleet (a daemon, one agent with a declared H100, one reference-engine worker of a
locally made model) and a gateway process. Each round sends one request straight to the
worker's Generate and one through the gateway (raw SSE over HTTP with httpx, so the
openai SDK's own parsing is not charged to the gateway), alternating so both see the same
machine load. Through the gateway a request also pays its Route call, its prompt's
tokenizing and its detokenizing: that is the overhead being measured.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/gateway_overhead.py --preset tiny --rounds 30

``--baseline-src DIR`` adds a third path, a gateway run from another source tree (``git
archive main gateway common proto | tar -x -C DIR``), so a change's before and after are
measured in the same run; ``--profile-gateway FILE`` runs the current one under cProfile.

Targets (issue 15): <= 2 ms added to TTFT at p50, <= 3 % fewer tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import grpc
import httpx
import numpy as np

from bench.gateway_fleet import MODEL, BenchFleet, bench_fleet, load_average
from fleetshift.v1 import worker_pb2, worker_pb2_grpc


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


async def measure(bench: BenchFleet, args: argparse.Namespace) -> None:
    prompt = [(7 * i) % 200 + 1 for i in range(args.prompt_tokens)]
    rows: dict[str, list[tuple[float, float]]] = {"direct": []}
    rows.update({f"gateway ({name})": [] for name in bench.gateways})
    async with (
        grpc.aio.insecure_channel(bench.worker) as ch,
        httpx.AsyncClient(timeout=300) as client,
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for i in range(args.warmup + args.rounds):
            results = {"direct": await direct(stub, prompt, args.max_tokens, i)}
            for name, gw in bench.gateways.items():
                results[f"gateway ({name})"] = await through(
                    client, gw.url, prompt, args.max_tokens
                )
            if i >= args.warmup:
                for path, value in results.items():
                    rows[path].append(value)
    report(rows, args)


def report(rows: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    print(
        f"preset={args.preset} rounds={args.rounds} prompt={args.prompt_tokens} "
        f"max_tokens={args.max_tokens} (sequential, one request in flight, paths alternating)"
    )
    print(f"{'path':<20}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'tok/s p50':>11}"
          f"{'added p50 ms':>14}{'paired ms':>11}{'tok/s lost':>12}")  # fmt: skip
    base = rows["direct"]
    base_ttft = np.median([v[0] for v in base]) * 1e3
    base_rate = np.median([v[1] for v in base])
    for path, values in rows.items():
        ttft = np.array([v[0] for v in values]) * 1e3
        rate = np.median([v[1] for v in values])
        paired = np.median([g[0] - d[0] for g, d in zip(values, base, strict=True)]) * 1e3
        print(
            f"{path:<20}{np.median(ttft):>13.2f}{np.percentile(ttft, 90):>13.2f}{rate:>11.1f}"
            f"{np.median(ttft) - base_ttft:>14.2f}{paired:>11.2f}"
            f"{(1 - rate / base_rate) * 100:>11.1f}%"
        )
    print("targets: added TTFT p50 <= 2 ms, tokens/s lost <= 3 %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also measure a gateway run from this source tree (e.g. `git archive` of main)",
    )
    parser.add_argument(
        "--profile-gateway", type=Path, help="run the current gateway under cProfile, stats here"
    )
    args = parser.parse_args()
    print(load_average(), "(start)")
    with bench_fleet(
        args.preset, baseline_src=args.baseline_src, profile=args.profile_gateway
    ) as bench:
        asyncio.run(measure(bench, args))
    print(load_average(), "(end)")


if __name__ == "__main__":
    main()
