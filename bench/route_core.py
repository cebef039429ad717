"""Core routing calls per second against a 1,000-node fleet, next to a round-robin baseline.

Measures only the domain core (no gRPC): Router.route with the output-length estimator and
the traffic monitor attached, as the daemon wires them. The baseline is a trivial round-robin
pick over the same per-model worker lists, timed in the same run. Both are timed in CPU
seconds of this process (time.process_time), so other jobs on a shared machine skew them
less than wall-clock time would.

    .venv/bin/python bench/route_core.py [--calls 50000] [--nodes 1000]
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

from fleetshift_daemon.core.estimator import OutputLengthEstimator
from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.perfmodel import ModelArch, PerfModel, llama2_70b
from fleetshift_daemon.core.routing import Role, Router, RouteRequest, Slo, WorkerView
from fleetshift_daemon.core.traffic import TrafficMonitor


def models() -> list[ModelArch]:
    small = ModelArch("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 128)
    mid = ModelArch("qwen2-32b", 64, 5120, 40, 8, 27648, 152064, 128)
    return [llama2_70b(), small, mid]


def fleet(n_nodes: int, rng: random.Random) -> list[WorkerView]:
    cat = default_catalogue()
    kinds = [cat.get(n) for n in ("A100-SXM-80GB", "H100-SXM", "H200-SXM")]
    archs = models()
    roles = (Role.MIXED, Role.PREFILL, Role.DECODE)
    out: list[WorkerView] = []
    for n in range(n_nodes):
        gpu = kinds[n % len(kinds)]
        for g in range(2):  # two TP-4 workers per 8-GPU node
            arch = archs[(n + g) % len(archs)]
            out.append(
                WorkerView(
                    id=f"n{n}-w{g}",
                    node=f"n{n}",
                    model=arch.name,
                    role=roles[rng.randrange(3)],
                    gpu=gpu,
                    tp=4 if arch.n_kv_heads % 4 == 0 else 8,
                    queue_tokens=rng.randrange(0, 20_000),
                    kv_used_tokens=rng.randrange(0, 100_000),
                    live_sessions=rng.randrange(0, 64),
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--nodes", type=int, default=1000)
    args = ap.parse_args()
    rng = random.Random(1)
    workers = fleet(args.nodes, rng)
    names = [m.name for m in models()]
    reqs = [
        RouteRequest(
            model=names[i % len(names)],
            prompt_tokens=rng.randrange(50, 8000),
            expected_output_tokens=None if i % 2 else rng.randrange(10, 1000),
            slo=Slo(ttft_ms=1000, tbt_ms=80) if i % 3 == 0 else None,
        )
        for i in range(4096)
    ]
    est = OutputLengthEstimator()
    for r in reqs:
        est.observe_completion(r.model, r.prompt_tokens, rng.randrange(10, 800))
    router = Router(PerfModel(), models(), estimator=est, traffic=TrafficMonitor(time.monotonic))
    t0 = time.perf_counter()
    router.update_fleet(workers)
    index_s = time.perf_counter() - t0

    by_model: dict[str, list[WorkerView]] = {}
    for w in workers:
        by_model.setdefault(w.model, []).append(w)
    rr = {m: itertools.cycle(ws) for m, ws in by_model.items()}

    def baseline(req: RouteRequest) -> str:
        if req.prompt_tokens <= 0 or req.model not in rr:
            raise ValueError(req.model)
        return next(rr[req.model]).id

    n = args.calls
    for r in reqs[:2000]:  # warm up
        router.route(r)
    t0 = time.process_time()
    for i in range(n):
        baseline(reqs[i & 4095])
    base_s = time.process_time() - t0
    t0 = time.process_time()
    for i in range(n):
        router.route(reqs[i & 4095])
    core_s = time.process_time() - t0
    print(
        f"fleet: {args.nodes} nodes, {len(workers)} workers, {len(names)} models; "
        f"index build {index_s * 1e3:.1f} ms"
    )
    print(f"round-robin baseline: {n / base_s:,.0f} calls/CPU-s ({base_s / n * 1e6:.2f} us/call)")
    print(f"core Router.route:    {n / core_s:,.0f} calls/CPU-s ({core_s / n * 1e6:.2f} us/call)")
    print(f"ratio core/baseline time: {core_s / base_s:.1f}x")


if __name__ == "__main__":
    main()
