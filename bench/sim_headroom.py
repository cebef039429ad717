"""Calibrate the planner's headroom with the simulator (how PlannerConfig's defaults were chosen).

The planner sizes a fleet from the performance model's capacity derated by ``utilisation``, with
decode batches whose step takes the unloaded step time plus ``decode_slack_fraction`` of the
slack up to the TBT SLO. Too little headroom and the fleet it plans meets the model and misses
the SLO in replay; too much and it keeps GPUs it does not need. This sweeps both on the
benchmark fleet and a *time slice* of the conversation trace (issue 11: defaults are chosen on
Azure minutes 0-30 only, the default slice, and reported on the rest) in several scenarios and
prints FleetShift's goodput, SLO attainment and cost next to least-loaded's, measured in the
same run, then the pick: the cheapest point whose SLO attainment stays within 1 point of
least-loaded's in every scenario (issue 11's bar)::

    .venv/bin/python bench/sim_headroom.py --slice 0,30 --scenarios x1,x4,on-off-x2

Scenarios: ``xN`` the slice time-compressed N times (Splitwise's scaling); ``on-off-xN`` the
slice's requests at 10x on-off burst arrivals (seed ``--seed``), compressed N times;
``shift-xN`` the slice with a prefill-then-decode shift, compressed N times; ``knee`` and
``shift`` the issue-7 scenarios (k-copies scaling x3.5).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fleetshift_daemon.core.perfmodel import Deployment, PerfModel
from fleetshift_daemon.core.planner import PlannerConfig
from fleetshift_daemon.sim.cli import SHIFTS
from fleetshift_daemon.sim.engine import SimConfig, Simulator
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.fleetshift import FleetShift
from fleetshift_daemon.sim.metrics import summarize
from fleetshift_daemon.sim.policies import LeastLoaded
from fleetshift_daemon.sim.synthetic import with_arrivals
from fleetshift_daemon.sim.timing import StepTimer
from fleetshift_daemon.sim.trace import Trace, load_trace, shifting_mix

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
# (utilisation, decode_slack_fraction): the old defaults first, the current ones marked
GRID = [
    (0.8, 1.0),
    (0.5, 1.0),
    (0.8, 0.2),
    (0.65, 0.2),
    (0.5, 0.2),
    (0.4, 0.2),
    (0.5, 0.1),
    (0.5, 0.5),
]
console = Console(width=200)


def scenario(name: str, base: Trace, seed: int = 0) -> Trace:
    if name == "knee":
        return base.rate_scaled(3.5, seed=0)
    if name == "shift":
        return shifting_mix(base, SHIFTS["prefill-then-decode"], seed=0).rate_scaled(3.5, seed=0)
    kind, _, rate = name.rpartition("x")
    kind = kind.rstrip("-")
    try:
        factor = float(rate)
    except ValueError:
        factor = 0.0
    if factor > 0 and kind == "":
        return base.time_compressed(factor)
    if factor > 0 and kind == "on-off":
        return with_arrivals(base, "on-off", seed=seed).time_compressed(factor)
    if factor > 0 and kind == "shift":
        mix = shifting_mix(base, SHIFTS["prefill-then-decode"], seed=seed)
        return mix.time_compressed(factor)
    raise SystemExit(f"unknown scenario {name!r} (xN, on-off-xN, shift-xN, knee, shift)")


def pick(rows: list[dict[str, object]]) -> str | None:
    """The cheapest grid point within 1 SLO point of ll in every scenario (mean $/M)."""
    ll = {r["scenario"]: r["slo_attainment"] for r in rows if r["policy"] == "ll"}
    points: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        if r["policy"] != "ll":
            points.setdefault(str(r["policy"]).replace(" (default)", ""), []).append(r)
    ok = {
        p: sum(float(str(r["cost_per_mtok"])) for r in rs) / len(rs)
        for p, rs in points.items()
        if all(float(str(r["slo_attainment"])) >= float(str(ll[r["scenario"]])) - 0.01 for r in rs)
    }
    return min(ok, key=ok.__getitem__) if ok else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="x1,x4,on-off-x2")
    ap.add_argument("--slice", default="0,30", help="trace minutes START,END (tuning: 0,30)")
    ap.add_argument("--grid", help="points U:SLACK,U:SLACK,... (default: the built-in grid)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic arrivals/shift")
    ap.add_argument("--out", type=Path, default=Path("/tmp/fleetshift-headroom.json"))
    args = ap.parse_args()
    start, end = (float(x) * 60.0 for x in args.slice.split(","))
    base = load_trace(TRACE).window(start, end)
    base = base.shifted(-float(base.arrival_s[0]))
    fleet, model = standard_fleet(), PerfModel()
    grid = GRID
    if args.grid:
        grid = [(float(a), float(b)) for a, b in (p.split(":") for p in args.grid.split(","))]
    default = PlannerConfig()
    rows: list[dict[str, object]] = []
    for name in args.scenarios.split(","):
        trace = scenario(name, base, args.seed)
        timers: dict[Deployment, StepTimer] = {}
        runs = [("ll", None, LeastLoaded())] + [
            (
                f"u={u:g} slack={f:g}",
                (u, f),
                FleetShift(planner_config=PlannerConfig(utilisation=u, decode_slack_fraction=f)),
            )
            for u, f in grid
        ]
        for label, knobs, policy in runs:
            t0 = time.perf_counter()
            sim = Simulator(fleet, trace, policy, model, SimConfig(), timers).run()
            s = summarize(sim, label, time.perf_counter() - t0)
            is_default = knobs == (default.utilisation, default.decode_slack_fraction)
            rows.append(
                {
                    "scenario": name,
                    "policy": label + (" (default)" if is_default else ""),
                    "goodput_rps": s.goodput_rps,
                    "slo_attainment": s.slo_attainment,
                    "cost_per_mtok": s.cost_per_mtok,
                    "ttft_p99_slowdown": s.ttft_slowdown_p99,
                    "tbt_p99_slowdown": s.tbt_slowdown_p99,
                    "moves": s.move_count,
                }
            )
            console.print(f"[dim]{name} {label}: {s.sim_wall_s:.1f} s[/dim]")
    table = Table(title="Planner headroom sweep (FleetShift vs least-loaded, same run)")
    for col in (
        "scenario",
        "policy",
        "goodput r/s",
        "SLO met",
        "$/M tok",
        "p99 TTFT/TBT x",
        "moves",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["scenario"],
            r["policy"],
            f"{r['goodput_rps']:.2f}",
            f"{r['slo_attainment']:.1%}",
            f"{r['cost_per_mtok']:.2f}",
            f"{r['ttft_p99_slowdown']:.1f} / {r['tbt_p99_slowdown']:.1f}",
            str(r["moves"]),
        )
    console.print(table)
    console.print(
        f"slice {args.slice} min; pick (cheapest within 1 point of ll everywhere): {pick(rows)}"
    )
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
