"""Route throughput and latency across daemon replicas (issue 17), 1,000 nodes, over gRPC.

Each round starts ``R`` ``fleetshiftd`` replicas on one fresh PostgreSQL database (the settings
of ``bench/failover.py``, nodes never turning lost during the round), registers the synthetic
fleet of ``bench/failover.py`` (1,000 nodes of 8 declared H100s, two TP-4 workers each) with
every replica through the real agent protocol, waits until every replica routes, then runs
``--clients`` client processes per mode, each a grpc.aio client keeping ``--concurrency`` Route
calls in flight on a channel listing every replica (round robin, as agents and the gateway are
given them). Modes, one after the other on the same replicas and fleet:

- ``unary``: one unary Route call per request (the baseline: what routers did before);
- ``stream``: the same requests through ``fleetshift_rpc.route_stream.RouteClient``, i.e. many
  Route requests per RouteStream call (one stream per replica per client process).

Baseline, same run: the same with one replica. No process is pinned: the replicas, the
PostgreSQL server and the clients share the machine's cores.

``--rates 500,1000,2000`` replaces the closed loop with an open one: calls arrive at that many
per second in all (Poisson, split over the client processes) whatever the answers do, and each
latency counts from the call's scheduled time, so a stalled replica's backlog shows in the tail
instead of slowing the arrivals (no coordinated omission). The p99 against the offered rate
shows where the machine's knee is, which a closed loop at saturation cannot.

``--full-read-s 10,300`` runs each round once per value of the followers' periodic full read
(``replicas.view_full_read_s``; 10 s was the fixed rule before 2026-12-05, 300 s the default
since), so the two are compared on the same machine in the same run.

Every phase has a deadline (``--phase-timeout``): a round that cannot register, serve or
finish says which phase stalled, shows the replicas' log tails and exits non-zero, instead of
waiting. (The two-replica round of 2026-12-02 "hung": it registered the 2,000 node/heartbeat
calls one at a time per replica, each retried up to 600 times with a 10 s timeout, and waited
for Route up to 2,400 times; on a machine at load 8 that is indistinguishable from a hang.)

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/route_replicas.py --replicas 1,2 --seconds 10

Target (issue 17): >= 5,000 Route calls/s across replicas on the 2 cores, p99 < 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psycopg

from bench.failover import PG_ADMIN, daemon_config, log_tails, node_messages, spawn
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_daemon.localfleet import _free_port
from fleetshift_rpc.replicas import aio_daemon_channel
from fleetshift_rpc.route_stream import RouteClient

MODES = ("unary", "stream")


async def client(
    addresses: str, seconds: float, concurrency: int, mode: str, rate: float
) -> dict[str, object]:
    latencies: list[float] = []
    refused = 0
    async with aio_daemon_channel(addresses) as ch:
        if mode == "stream":
            stream = RouteClient(ch, lanes=len(addresses.split(",")))
            route = stream.route
        else:
            route = pb_grpc.PlacementStub(ch).Route
        rng = np.random.default_rng(os.getpid())
        prompts = rng.integers(50, 4000, 10_000)
        outputs = rng.integers(10, 1500, 10_000)
        deadline = time.perf_counter() + seconds

        async def call(i: int, t0: float) -> None:
            """One Route; its latency counts from ``t0`` (when it was due)."""
            nonlocal refused
            request = pb.RouteRequest(
                model="llama-70b",
                prompt_tokens=int(prompts[i % 10_000]),
                expected_output_tokens=int(outputs[i % 10_000]),
            )
            try:
                await route(request, timeout=5)
                latencies.append(time.perf_counter() - t0)
            except grpc.aio.AioRpcError:
                refused += 1

        async def one(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                await call(i, time.perf_counter())
                i += concurrency

        async def arrivals() -> None:
            due, in_flight = time.perf_counter(), set()
            for i, gap in enumerate(rng.exponential(1 / rate, int(rate * seconds * 2) + 10)):
                due += gap
                if due >= deadline:
                    break
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                task = asyncio.create_task(call(i, due))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.gather(*in_flight)

        start = time.perf_counter()
        if rate > 0:
            await arrivals()
        else:
            await asyncio.gather(*(one(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
        if mode == "stream":
            await stream.close()
    return {"calls": len(latencies), "elapsed": elapsed, "refused": refused,
            "latencies_ms": [round(x * 1000, 3) for x in latencies]}  # fmt: skip


async def register(address: str, nodes: int, in_flight: int = 16) -> None:
    """Every node once, as its agent would (``in_flight`` agents at a time), each call retried
    while the replica is starting or briefly refuses to write; the caller bounds the time."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = fpb_grpc.AgentRegistryStub(ch)
        todo = iter(range(nodes))

        async def agent() -> None:
            for n in todo:
                reg, beat = node_messages(n)
                for call, msg in ((stub.RegisterNode, reg), (stub.Heartbeat, beat)):
                    while True:
                        try:
                            await call(msg, timeout=10)
                            break
                        except grpc.aio.AioRpcError:
                            await asyncio.sleep(0.1)

        await asyncio.gather(*(agent() for _ in range(in_flight)))


async def routes(address: str) -> None:
    """Until the replica answers a Route (the caller bounds the time)."""
    async with grpc.aio.insecure_channel(address) as ch:
        route = pb_grpc.PlacementStub(ch).Route
        request = pb.RouteRequest(model="llama-70b", prompt_tokens=500, expected_output_tokens=200)
        while True:
            try:
                await route(request, timeout=2)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)


class Stalled(Exception):
    pass


def phase(name: str, limit_s: float, coro: Coroutine[Any, Any, None]) -> float:
    """Run one phase of a round within ``limit_s``; returns how long it took."""
    t0 = time.perf_counter()
    try:
        asyncio.run(asyncio.wait_for(coro, limit_s))
    except TimeoutError:
        raise Stalled(f"phase '{name}' did not finish within {limit_s:g} s") from None
    took = time.perf_counter() - t0
    print(f"  {name}: {took:.1f} s", flush=True)
    return took


def round_with(
    tmp: Path, replicas: int, nodes: int, args: argparse.Namespace, full_read_s: float
) -> dict[str, dict[str, float]]:
    name = f"fleetshift_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"
    ports = [_free_port() for _ in range(replicas)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    configs = [daemon_config(tmp, f"{name}-{i}", p, url) for i, p in enumerate(ports)]
    for config in configs:  # no heartbeats follow the registration: keep the nodes ready
        text = config.read_text().replace("node_lost_after_s = 30", "node_lost_after_s = 3600")
        text = text.replace(
            "view_refresh_s = 0.2",
            f"view_refresh_s = {args.view_refresh_s}\nview_full_read_s = {full_read_s}",
        )
        if args.default_lease:  # the daemon's own lease settings, not the failover bench's
            text = "\n".join(
                line for line in text.splitlines() if not line.startswith(("lease_ttl_s", "renew_"))
            )
        config.write_text(text)
    procs = [spawn(config) for config in configs]
    limit = args.phase_timeout
    out: dict[str, dict[str, float]] = {}
    try:
        for i, address in enumerate(addresses[: 1 if args.register_at_first else None]):
            phase(f"register {nodes} nodes at replica {i}", limit, register(address, nodes))
        for i, address in enumerate(addresses):
            phase(f"replica {i} routes", limit, routes(address))
        for mode in args.modes.split(","):
            for rate in [float(r) for r in args.rates.split(",")] if args.rates else [0.0]:
                label = f"{mode} @ {rate:,.0f}/s offered" if rate else mode
                out[label] = run_clients(tmp, name, addresses, mode, args, rate)
                out[label]["deposed"] = sum(_log_count(c, "leadership: deposed") for c in configs)
    except Stalled as err:
        print(f"STALLED ({replicas} replica(s)): {err}\n{log_tails(tmp)}", flush=True)
        raise
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return out


def run_clients(
    tmp: Path,
    name: str,
    addresses: list[str],
    mode: str,
    args: argparse.Namespace,
    rate_asked: float,
) -> dict[str, float]:
    """Run the client processes once; ``rate_asked`` > 0: open loop at that total rate."""
    outs = [tmp / f"{name}-{mode}-{rate_asked:g}-client-{k}.json" for k in range(args.clients)]
    argv = [sys.executable, __file__, "--client", ",".join(addresses), str(args.seconds),
            str(args.concurrency), mode, str(rate_asked / args.clients)]  # fmt: skip
    clients = [subprocess.Popen([*argv, str(out)]) for out in outs]
    try:
        for proc in clients:
            if proc.wait(timeout=args.seconds + args.phase_timeout) != 0:
                raise Stalled(f"a {mode} client exited with status {proc.returncode}")
    except subprocess.TimeoutExpired:
        raise Stalled(
            f"{mode} clients did not finish within {args.seconds + args.phase_timeout:g} s"
        ) from None
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = [json.loads(out.read_text()) for out in outs]
    lat = np.concatenate([np.array(r["latencies_ms"], dtype=float) for r in results])
    p50, p99 = np.percentile(lat, [50, 99]) if lat.size else (float("nan"), float("nan"))
    rate = sum(r["calls"] / r["elapsed"] for r in results)
    print(f"  {mode} ({offered(rate_asked)}): {rate:,.0f} Route/s, p50 {p50:.2f} ms, "
          f"p99 {p99:.2f} ms", flush=True)  # fmt: skip
    return {
        "rate": rate,
        "p50": float(p50),
        "p99": float(p99),
        "refused": sum(r["refused"] for r in results),
    }


def offered(rate: float) -> str:
    return f"open loop, {rate:,.0f}/s offered" if rate else "closed loop"


def _log_count(config: Path, line: str) -> int:
    log = config.with_suffix(".log")
    return log.read_text(errors="replace").count(line) if log.exists() else 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        addresses, seconds, concurrency, mode, rate, out = sys.argv[2:8]
        result = asyncio.run(client(addresses, float(seconds), int(concurrency), mode, float(rate)))
        Path(out).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", default="1,2", help="replica counts, the first the baseline")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES), help="unary (baseline), stream")
    parser.add_argument("--view-refresh-s", type=float, default=0.2,
                        help="followers re-read the database this often (the daemon's default: 0.5)")  # fmt: skip
    parser.add_argument("--default-lease", action="store_true",
                        help="the daemon's lease settings (TTL 5 s) instead of the failover bench's (3 s)")  # fmt: skip
    parser.add_argument("--register-at-first", action="store_true",
                        help="agents register with the first replica only (the others read the fleet from the database)")  # fmt: skip
    parser.add_argument("--rates", default="",
                        help="open loop: offered Route calls/s in all, a run each (e.g. 500,1000,2000); empty: closed loop")  # fmt: skip
    parser.add_argument("--full-read-s", default="300",
                        help="followers' full-read intervals, a round each (e.g. 10,300)")  # fmt: skip
    parser.add_argument("--phase-timeout", type=float, default=300.0,
                        help="seconds any one phase of a round may take before the bench stops")  # fmt: skip
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    print(f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[tuple[int, float, dict[str, dict[str, float]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(c) for c in args.replicas.split(",")):
            for full_read_s in (float(v) for v in args.full_read_s.split(",")):
                print(f"{count} replica(s), full read every {full_read_s:g} s:", flush=True)
                try:
                    by_mode = round_with(Path(tmp), count, args.nodes, args, full_read_s)
                except Stalled:
                    sys.exit(3)
                rows.append((count, full_read_s, by_mode))
    print(f"\nload average at end {os.getloadavg()[0]:.1f}; {args.nodes} nodes; {args.clients} client "
          f"processes x {args.concurrency} in flight; {args.seconds:g} s per mode; nothing pinned")  # fmt: skip
    print("| replicas | full read s | client | Route calls/s | p50 ms | p99 ms | refused "
          "| deposals (round) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for count, full_read_s, by_mode in rows:
        for mode, r in by_mode.items():
            print(f"| {count} | {full_read_s:g} | {mode} | {r['rate']:,.0f} | {r['p50']:.2f} | "
                  f"{r['p99']:.2f} | {r['refused']:.0f} | {r['deposed']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
