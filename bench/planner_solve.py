"""Planner solve time for fleets of 100, 1,000 and 10,000 GPUs (4 GPU kinds, 10 models).

Each size is solved from scratch (options, two-stage MILP, node assignment, evaluation of the
result). The baseline, timed in the same run on the same input, is a greedy heuristic
placement (fill each kind's GPUs with mixed workers of the model with the most unmet demand)
followed by the same evaluation; the printed ratio is MILP solve time / greedy time, and the
goodput and $/hour of both placements are printed so the time buys something visible.

    .venv/bin/python bench/planner_solve.py [--repeats 3] [--rate 30] [--plan]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.perfmodel import Dtype, ModelArch, PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelDemand,
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    PlanningInput,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.plans import build_plan
from fleetshift_daemon.core.routing import Role

RATE = 6.0  # requests/s per model per 100 GPUs (x1..x3 by model); --rate changes it
KINDS = ("A100-SXM-80GB", "H100-SXM", "H200-SXM", "L40S")


def models() -> list[ModelSpec]:
    archs = [
        llama2_70b(),
        ModelArch("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 128),
        ModelArch("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 128),
        ModelArch("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, 128),
        ModelArch("qwen2-32b", 64, 5120, 40, 8, 27648, 152064, 128),
        ModelArch("qwen2-72b", 80, 8192, 64, 8, 29568, 152064, 128),
        ModelArch("mistral-7b", 32, 4096, 32, 8, 14336, 32768, 128),
        ModelArch("mixtral-dense-47b", 32, 4096, 32, 8, 14336 * 6, 32000, 128),
        ModelArch("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 128),
        ModelArch("gptj-6b", 28, 4096, 16, 16, 16384, 50400, 256, gated_mlp=False),
    ]
    return [
        ModelSpec(a, dtypes=(Dtype.BF16, Dtype.FP8), tp_options=(1, 2, 4, 8), min_workers=1)
        for a in archs
    ]


def fleet_input(n_gpus: int) -> PlanningInput:
    cat = default_catalogue()
    nodes = []
    for i in range(n_gpus // 8):
        nodes.append(NodeCapacity(f"n{i}", cat.get(KINDS[i % len(KINDS)]), 8, cordoned=i % 50 == 7))
    specs = models()
    scale = n_gpus / 100
    demand = [
        ModelDemand(
            s.arch.name, RATE * scale * (1 + i % 3), 300 + 700 * (i % 4), 80 + 150 * (i % 5)
        )
        for i, s in enumerate(specs)
    ]
    return planning_input(nodes, specs, demand, default_slo=SloTarget(ttft_ms=2000, tbt_ms=100))


def greedy(planner: Planner, inp: PlanningInput) -> Placement:
    """Mixed workers at the smallest TP that runs, each GPU to the model with most unmet
    demand (served tokens/s of a worker from its phase capacities)."""
    opts = [o for o in planner.options(inp) if o.role is Role.MIXED]
    unmet = {
        d.model: d.arrival_rate_per_s * (d.mean_prompt_tokens + d.mean_output_tokens)
        for d in inp.demand.values()
    }
    placed = []
    for node in inp.nodes:
        if node.cordoned:
            continue
        free = node.gpu_count
        while True:
            fits = [o for o in opts if o.key[2] == node.gpu.name and o.tp <= free]
            if not fits:
                break
            model = max(unmet, key=lambda m: unmet[m] if any(o.model == m for o in fits) else -1)
            cands = [o for o in fits if o.model == model]
            if not cands:
                break
            o = min(cands, key=lambda o: o.tp)
            placed.append(PlacedWorker(o.model, o.role, o.key[2], o.tp, o.key[4], node.name))
            d = inp.demand[model]
            per_request = (
                d.mean_prompt_tokens / o.prefill_tokens_per_s
                + d.mean_output_tokens / o.decode_tokens_per_s
            )
            unmet[model] -= (d.mean_prompt_tokens + d.mean_output_tokens) / per_request
            free -= o.tp
    return Placement(tuple(placed))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--rate", type=float, default=RATE)
    ap.add_argument("--plan", action="store_true", help="also time build_plan greedy -> best")
    args = ap.parse_args()
    plans: list[tuple[int, float, int, float]] = []
    globals()["RATE"] = args.rate
    planner = Planner(PerfModel())
    print(
        f"{'GPUs':>6} {'nodes':>6} {'options':>7} {'MILP solve s':>12} {'greedy s':>9} "
        f"{'ratio':>6} {'demand tok/s':>13} {'goodput MILP':>13} {'LP bound':>13} "
        f"{'goodput greedy':>14} {'$/h MILP':>9} {'$/h greedy':>10} {'unplaced':>8} status"
    )
    for size in (int(s) for s in args.sizes.split(",")):
        inp = fleet_input(size)
        n_opts = len(planner.options(inp))
        solve_times, greedy_times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sol = planner.solve(inp)
            solve_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            g = greedy(planner, inp)
            g_eval = planner.evaluate(inp, g)
            greedy_times.append(time.perf_counter() - t0)
        s, gt = statistics.median(solve_times), statistics.median(greedy_times)
        print(
            f"{size:>6} {len(inp.nodes):>6} {n_opts:>7} {s:>12.3f} {gt:>9.3f} {s / gt:>6.1f} "
            f"{sol.evaluation.demand_tokens_per_s:>13,.0f} "
            f"{sol.evaluation.goodput_tokens_per_s:>13,.0f} "
            f"{sol.goodput_bound_tokens_per_s:>13,.0f} "
            f"{g_eval.goodput_tokens_per_s:>14,.0f} {sol.evaluation.cost_per_hour:>9,.0f} "
            f"{g_eval.cost_per_hour:>10,.0f} {len(sol.unplaced):>8} {sol.status}"
        )
        if args.plan:
            plans.append((size, *time_plan(planner, inp, g)))
    for size, secs, n_moves, eff in plans:
        print(
            f"plan greedy -> best, {size} GPUs: {n_moves} moves priced with marginal gains in "
            f"{secs:.2f} s (efficiency of the greedy placement {eff:.2f})"
        )


def time_plan(planner: Planner, inp: PlanningInput, g: Placement) -> tuple[float, int, float]:
    """build_plan from the greedy placement (as running workers) to the best placement."""
    perf = PerfModel()
    current = Placement(
        tuple(
            PlacedWorker(w.model, w.role, w.gpu_kind, w.tp, w.dtype, w.node, f"w{i}", 8, 8000)
            for i, w in enumerate(g.workers)
        )
    )
    t0 = time.perf_counter()
    plan = build_plan(Planner(perf), perf, inp, current)
    return time.perf_counter() - t0, len(plan.moves), plan.efficiency_before


if __name__ == "__main__":
    main()
