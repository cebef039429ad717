"""Benchmark: does FleetShift's placement pay on real traffic? (results: docs/bench-sim.md)

Fleet: 4 DGX-A100 80GB + 4 DGX-H100 + 4 DGX-H200, Llama-2-70B BF16 at TP 8 (12 instances).
Trace: the Azure LLM inference conversation trace (2023-11-16, ~1 h; Splitwise, ISCA'24).

1. Find the rate scale at which round-robin just misses the Splitwise SLO (P99 TTFT <= 6x and
   P99 TBT <= 5x unloaded), on a 0.25 grid, and compare all policies there.
2. A shifting mix at the same scale: prefill-heavy first half, decode-heavy second half.
3. Simulation speed of the 1x trace, against a baseline measured in the same run (loading the
   trace and iterating its requests once in Python).
4. Throughput at SLO (Splitwise's comparison): per policy, the largest rate scale (bisection,
   0.125 resolution) at which it still meets the P99 SLO; and goodput at 1.5x the knee.

    .venv/bin/python bench/sim_fleet.py [--out DIR] [--img docs/img] [--skip-oracle]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from fleetshift_daemon.sim.cli import SHIFTS
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.report import (
    draw_plots,
    print_table,
    require_matplotlib,
    write_outputs,
)
from fleetshift_daemon.sim.runner import POLICIES, RunResult, run_policies
from fleetshift_daemon.sim.trace import load_trace, shifting_mix

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
console = Console(width=200)


def headline(results: list[RunResult]) -> dict[str, float]:
    by = {r.name: r.summary for r in results}
    base = max((by[n] for n in ("rr", "ll") if n in by), key=lambda s: s.goodput_rps)
    out: dict[str, float] = {"baseline_is_" + base.policy: 1.0}
    for name in ("fleetshift", "fleetshift-all"):
        fs = by.get(name)
        if fs is None:
            continue
        out[f"{name}_goodput_ratio_vs_best_baseline"] = fs.goodput_rps / base.goodput_rps
        out[f"{name}_cost_per_good_mtok_change"] = (
            fs.cost_per_good_mtok / base.cost_per_good_mtok - 1
        )
        out[f"{name}_cost_per_mtok_change"] = fs.cost_per_mtok / base.cost_per_mtok - 1
        if "oracle" in by:
            out[f"{name}_vs_oracle_goodput"] = fs.goodput_rps / by["oracle"].goodput_rps
    if "split" in by:
        out["split_goodput_ratio_vs_best_baseline"] = by["split"].goodput_rps / base.goodput_rps
    if "oracle" in by:
        out["oracle_goodput_ratio_vs_best_baseline"] = by["oracle"].goodput_rps / base.goodput_rps
    return out


def find_knee(
    trace, fleet, grid: list[float]
) -> tuple[float, list[tuple[float, bool, float, float]]]:
    """The smallest scale on ``grid`` at which round-robin misses the P99 SLO."""
    seen = []
    for scale in grid:
        r = run_policies(fleet, trace.rate_scaled(scale, seed=0), ["rr"])[0].summary
        ok = r.meets_p99_slo()
        seen.append((scale, ok, r.ttft_slowdown_p99, r.tbt_slowdown_p99))
        console.print(
            f"rr at x{scale:g}: p99 slowdown TTFT {r.ttft_slowdown_p99:.2f} TBT "
            f"{r.tbt_slowdown_p99:.2f} -> {'meets' if ok else 'misses'} ({r.sim_wall_s:.1f} s)"
        )
        if not ok:
            return scale, seen
    return grid[-1], seen


def max_scale(trace, fleet, policy: str, lo: float, hi: float, step: float = 0.125) -> float:
    """Largest scale in [lo, hi] (to ``step``) meeting the P99 SLO; ``lo`` if none does."""

    def ok(scale: float) -> bool:
        r = run_policies(fleet, trace.rate_scaled(scale, seed=0), [policy])[0].summary
        console.print(
            f"  {policy} at x{scale:g}: p99 slowdown TTFT {r.ttft_slowdown_p99:.2f} "
            f"TBT {r.tbt_slowdown_p99:.2f} ({r.sim_wall_s:.1f} s)"
        )
        return r.meets_p99_slo()

    if not ok(lo):
        return 0.0
    while hi - lo > step:
        mid = round((lo + hi) / 2 / step) * step
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/fleetshift-bench-sim"))
    ap.add_argument("--img", type=Path, help="also draw the plots here (docs/img)")
    ap.add_argument("--skip-oracle", action="store_true")
    ap.add_argument("--scale", type=float, help="skip the search, use this rate scale")
    args = ap.parse_args()
    require_matplotlib()  # fail now, not after half an hour of runs
    fleet = standard_fleet(tp=8)
    policies = [p for p in POLICIES if not (args.skip_oracle and p == "oracle")]
    report: dict[str, object] = {}

    # 3. speed first (quiet machine): baseline = load + iterate the trace
    t0 = time.perf_counter()
    trace = load_trace(TRACE)
    total = 0
    for a, p, o in zip(
        trace.arrival_s.tolist(),
        trace.prompt_tokens.tolist(),
        trace.output_tokens.tolist(),
        strict=True,
    ):
        total += p + o + int(a >= 0)
    load_s = time.perf_counter() - t0
    speed = run_policies(fleet, trace, policies)
    print_table(speed, "1x trace (speed run)", console)
    report["speed"] = {
        "baseline_load_and_iterate_s": load_s,
        **{f"{r.name}_s": r.summary.sim_wall_s for r in speed},
        **{f"{r.name}_x_baseline": r.summary.sim_wall_s / load_s for r in speed},
        **{f"{r.name}_x_rr": r.summary.sim_wall_s / speed[0].summary.sim_wall_s for r in speed},
        "events_rr": speed[0].summary.events,
    }
    report["x1"] = {"headline": headline(speed), "policies": [r.summary.as_dict() for r in speed]}

    # 1. the knee of round-robin
    if args.scale is None:
        scale, seen = find_knee(trace, fleet, [1.5 + 0.25 * i for i in range(20)])
        report["knee_search"] = seen
    else:
        scale = args.scale
    scaled = trace.rate_scaled(scale, seed=0)
    knee = run_policies(
        fleet,
        scaled,
        policies,
        on_done=lambda r: console.print(f"{r.name}: {r.summary.sim_wall_s:.1f} s"),
    )
    print_table(knee, f"conversation trace at x{scale:g} ({len(scaled)} requests)", console)
    write_outputs(args.out / "knee", knee, {"scale": scale})
    report["knee"] = {
        "scale": scale,
        "headline": headline(knee),
        "policies": [r.summary.as_dict() for r in knee],
    }

    # 2. shifting mix
    shifted = shifting_mix(trace, SHIFTS["prefill-then-decode"], seed=0).rate_scaled(scale, seed=0)
    shift = run_policies(
        fleet,
        shifted,
        policies,
        on_done=lambda r: console.print(f"{r.name}: {r.summary.sim_wall_s:.1f} s"),
    )
    print_table(shift, f"prefill-then-decode mix at x{scale:g} ({len(shifted)} requests)", console)
    write_outputs(args.out / "shift", shift, {"scale": scale, "shift": "prefill-then-decode"})
    report["shift"] = {
        "scale": scale,
        "headline": headline(shift),
        "policies": [r.summary.as_dict() for r in shift],
    }
    # 4. throughput at SLO, and goodput past the knee
    capacity = {}
    for name in [p for p in policies if p != "oracle"]:
        capacity[name] = max_scale(trace, fleet, name, 1.0, 8.0)
        console.print(f"{name}: meets the P99 SLO up to x{capacity[name]:g}")
    best_base = max(capacity["rr"], capacity["ll"])
    report["throughput_at_slo"] = {
        "max_scale": capacity,
        **{f"{k}_vs_best_baseline": v / best_base for k, v in capacity.items()},
    }
    over_scale = round(1.5 * scale * 4) / 4
    over = run_policies(
        fleet,
        trace.rate_scaled(over_scale, seed=0),
        policies,
        on_done=lambda r: console.print(f"{r.name}: {r.summary.sim_wall_s:.1f} s"),
    )
    print_table(over, f"conversation trace at x{over_scale:g} (1.5x the knee)", console)
    write_outputs(args.out / "overload", over, {"scale": over_scale})
    report["overload"] = {
        "scale": over_scale,
        "headline": headline(over),
        "policies": [r.summary.as_dict() for r in over],
    }

    if args.img:
        args.img.mkdir(parents=True, exist_ok=True)
        draw_plots(args.img, knee, prefix="sim-knee-")
        draw_plots(args.img, shift, prefix="sim-shift-")

    (args.out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print_json(
        json.dumps({k: v for k, v in report.items() if k in ("speed",)}, default=str)
    )
    console.print("throughput at SLO", report["throughput_at_slo"])
    for k in ("x1", "knee", "shift", "overload"):
        console.print(k, report[k]["headline"])  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
