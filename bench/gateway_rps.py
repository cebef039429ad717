"""Gateway requests/s on one core, and the latency it adds under load, against the worker
called directly in the same run.

The fleet of ``bench/gateway_fleet.py`` (the reference engine's smallest model, ``tiny``, by
default) with the gateway pinned to one CPU (``taskset -c``). Closed-loop load: ``--clients``
concurrent callers, each sending short non-streamed requests back to back, in alternating
blocks of ``--block-s`` seconds straight to the worker's ``Generate`` (the baseline) and
through the gateway (the official request shape, JSON over HTTP with httpx). Reported per
path: requests/s achieved, latency p50/p99, and for a gateway what it added at p50/p99 and
the CPU seconds the gateway process spent per request (from /proc), whose inverse is what one
core of it can serve when the worker is not the bottleneck. ``--baseline-src DIR`` adds a
gateway run from another source tree (``git archive main gateway common proto``), so a
change's before and after are measured in the same run.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/gateway_rps.py --clients 8 --blocks 3

``--stream`` has the gateway's clients stream their answers (server-sent events, every event
read), the path most applications take.

On a shared machine the achieved rate is bounded by the worker and the client as much as by
the gateway: the CPU-per-request figure is the gateway's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc
import httpx
import numpy as np

from bench.gateway_fleet import (
    MODEL,
    BenchFleet,
    add_fleet_arguments,
    bench_prompt,
    cpu_seconds,
    fleet_for,
    load_average,
)
from fleetshift.v1 import worker_pb2, worker_pb2_grpc


async def _direct_loop(
    stub: worker_pb2_grpc.WorkerServiceStub, prompt: list[int], n: int, until: float, i: int
) -> list[float]:
    out, k = [], 0
    while time.perf_counter() < until:
        k += 1
        req = worker_pb2.GenerateRequest(
            prompt_tokens=prompt,
            max_new_tokens=n,
            sampling=worker_pb2.WorkerSampling(temperature=0.0),
            session_id=f"rps-{i}-{k}-{time.monotonic_ns()}",
        )
        start = time.perf_counter()
        got = [m async for m in stub.Generate(req)]
        assert len(got) == n
        out.append(time.perf_counter() - start)
    return out


async def _gateway_loop(
    client: httpx.AsyncClient, url: str, prompt: list[int], n: int, until: float
) -> list[float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    out = []
    while time.perf_counter() < until:
        start = time.perf_counter()
        reply = await client.post(url + "/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == n
        out.append(time.perf_counter() - start)
    return out


async def _streaming_loop(
    client: httpx.AsyncClient, url: str, prompt: list[int], n: int, until: float
) -> list[float]:
    """The same requests streamed (server-sent events), every event read."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    out = []
    while time.perf_counter() < until:
        start = time.perf_counter()
        async with client.stream("POST", url + "/completions", json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            events = [line async for line in reply.aiter_lines() if line.startswith("data: {")]
        assert len(events) == n, events
        out.append(time.perf_counter() - start)
    return out


async def measure(bench: BenchFleet, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    prompt = bench_prompt(args.prompt_tokens)
    paths = ["direct", *bench.gateways]
    lat: dict[str, list[float]] = {path: [] for path in paths}
    secs = dict.fromkeys(paths, 0.0)
    cpu = dict.fromkeys(paths, 0.0)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with (
        grpc.aio.insecure_channel(bench.worker) as ch,
        httpx.AsyncClient(timeout=120, limits=limits, headers=bench.auth()) as client,
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        warm = time.perf_counter() + 3
        through = _streaming_loop if args.stream else _gateway_loop
        await asyncio.gather(
            _direct_loop(stub, prompt, args.max_tokens, warm, -1),
            *(through(client, gw.url, prompt, args.max_tokens, warm)
              for gw in bench.gateways.values()),
        )  # fmt: skip
        for block in range(args.blocks):
            for path in paths:
                until = time.perf_counter() + args.block_s
                gw = bench.gateways.get(path)
                cpu0, t0 = cpu_seconds(gw.proc.pid) if gw else 0.0, time.perf_counter()
                if gw is None:
                    loops = [
                        _direct_loop(stub, prompt, args.max_tokens, until, block * 100 + i)
                        for i in range(args.clients)
                    ]
                else:
                    loops = [
                        through(client, gw.url, prompt, args.max_tokens, until)
                        for _ in range(args.clients)
                    ]
                done = await asyncio.gather(*loops)
                secs[path] += time.perf_counter() - t0
                lat[path] += [x for one in done for x in one]
                if gw is not None:
                    cpu[path] += cpu_seconds(gw.proc.pid) - cpu0
    stats = {}
    for path, values in lat.items():
        ms = np.array(values) * 1e3
        stats[path] = {
            "n": len(values),
            "rps": len(values) / secs[path],
            "p50": float(np.median(ms)),
            "p99": float(np.percentile(ms, 99)),
            "cpu_ms": cpu[path] / len(values) * 1e3,
        }
    return stats


def report(stats: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"preset={args.preset} clients={args.clients} prompt={args.prompt_tokens} "
        f"max_tokens={args.max_tokens} blocks={args.blocks}x{args.block_s}s per path, "
        f"gateways pinned to CPU {args.cpu}, {'streamed' if args.stream else 'not streamed'}"
    )
    print(
        f"{'path':<20}{'requests':>9}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'+p50 ms':>9}{'+p99 ms':>9}{'CPU ms/req':>12}{'req/s/core':>12}"
    )
    d = stats["direct"]
    for path, s in stats.items():
        gateway = path != "direct"
        extra = (
            f"{s['p50'] - d['p50']:>+9.1f}{s['p99'] - d['p99']:>+9.1f}"
            f"{s['cpu_ms']:>12.2f}{1000 / s['cpu_ms']:>12.0f}"
            if gateway
            else ""
        )
        print(f"{path:<20}{s['n']:>9.0f}{s['rps']:>8.1f}{s['p50']:>9.1f}{s['p99']:>9.1f}{extra}")
    print(
        "req/s/core: 1 / the gateway's CPU time per request, what one core of it serves when "
        "the worker is not the limit"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_fleet_arguments(parser)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block-s", type=float, default=10.0)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--cpu", default="1", help="the CPU the gateway is pinned to")
    parser.add_argument(
        "--stream", action="store_true", help="the gateway's clients stream (server-sent events)"
    )
    args = parser.parse_args()
    print(load_average(), "(start)")
    with fleet_for(args, pin_gateway=args.cpu) as bench:
        stats = asyncio.run(measure(bench, args))
    report(stats, args)
    print(load_average(), "(end)")


if __name__ == "__main__":
    main()
