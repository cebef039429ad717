"""Calibrate the planner's headroom with the simulator (how PlannerConfig's defaults were chosen).

The planner sizes a fleet from the performance model's capacity derated by ``utilisation``, with
decode batches whose step takes the unloaded step time plus ``decode_slack_fraction`` of the
slack up to the TBT SLO. Too little headroom and the fleet it plans meets the model and misses
the SLO in replay; too much and it keeps GPUs it does not need. This sweeps both on the
benchmark fleet and the conversation trace in three scenarios (1x, round-robin's knee x3.5, the
shifting mix at x3.5) and prints FleetShift's goodput, SLO attainment and cost next to
least-loaded's, measured in the same run.

    .venv/bin/python bench/sim_headroom.py [--scenarios x1,knee,shift] [--out FILE.json]
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


def scenario(name: str, base: Trace) -> Trace:
    if name == "x1":
        return base
    if name == "knee":
        return base.rate_scaled(3.5, seed=0)
    if name == "shift":
        return shifting_mix(base, SHIFTS["prefill-then-decode"], seed=0).rate_scaled(3.5, seed=0)
    raise SystemExit(f"unknown scenario {name!r} (x1, knee, shift)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="x1,knee,shift")
    ap.add_argument("--out", type=Path, default=Path("/tmp/fleetshift-headroom.json"))
    args = ap.parse_args()
    base, fleet, model = load_trace(TRACE), standard_fleet(), PerfModel()
    default = PlannerConfig()
    rows = []
    for name in args.scenarios.split(","):
        trace = scenario(name, base)
        timers: dict[Deployment, StepTimer] = {}
        runs = [("ll", None, LeastLoaded())] + [
            (
                f"u={u:g} slack={f:g}",
                (u, f),
                FleetShift(planner_config=PlannerConfig(utilisation=u, decode_slack_fraction=f)),
            )
            for u, f in GRID
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
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
