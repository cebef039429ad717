"""The hindsight bound, old and new, beside the policies it bounds (issue 11).

``sim.oracle`` used to choose, per 5-minute window, among four role shapes (the planner's, the
planner's for an owned fleet, the balanced split, all mixed); it now also searches every role
count along the fleet's phase order (see its docstring). This runs, on each validation trace
and rate, ``ll``, ``split`` and ``fleetshift-all`` and both bounds on the same fleet and trace,
and prints ``fleetshift-all``'s goodput as a share of each bound (issue 11: within 5 %)::

    .venv/bin/python bench/sim_oracle.py --traces mooncake-0-30,on-off --rates 2 --minutes 10

The rows say which traces are tuning data and which are held out (``sim.validation``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fleetshift_daemon.core.perfmodel import PerfModel
from fleetshift_daemon.sim.engine import SimConfig, Simulator
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.metrics import summarize
from fleetshift_daemon.sim.oracle import OraclePolicy, run_oracle
from fleetshift_daemon.sim.runner import RunOptions, run_policies
from fleetshift_daemon.sim.validation import validation_traces

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
POLICIES = ("ll", "split", "fleetshift-all")


def run(name: str, rate: float, minutes: float) -> dict[str, float | str | bool]:
    (v,) = validation_traces(
        SHARED / "azure_llm_2023_conv.csv",
        SHARED / "mooncake_conversation_trace.jsonl",
        (name,),
        span_s=minutes * 60.0 if minutes > 0 else None,
    )
    v = v.compressed(rate)
    fleet = standard_fleet(preset=v.model)
    model = PerfModel()
    row: dict[str, float | str | bool] = {"trace": name, "rate": rate, "tuning": v.tuning}
    for r in run_policies(fleet, v.trace, POLICIES, RunOptions(), model):
        row[r.name] = r.summary.goodput_rps
    for label, search in (("bound-4", False), ("bound-roles", True)):
        t0 = time.perf_counter()
        sim = Simulator(fleet, v.trace, OraclePolicy(), model, SimConfig())
        sim = run_oracle(sim, role_search=search)
        row[label] = summarize(sim, "oracle").goodput_rps
        row[f"{label} s"] = time.perf_counter() - t0
    return row


def line(r: dict[str, float | str | bool]) -> str:
    fa = float(r["fleetshift-all"])
    old, new = float(r["bound-4"]), float(r["bound-roles"])
    best = max(float(r["ll"]), float(r["split"]))
    share = fa / max(new, 1e-9)
    return (
        f"| {r['trace']} | {'tuning' if r['tuning'] else 'held out'} | x{r['rate']:g} "
        f"| {r['ll']:.2f} / {r['split']:.2f} | {fa:.2f} | {old:.2f} ({fa / max(old, 1e-9):.3f}x) "
        f"| {new:.2f} ({share:.3f}x) {'met' if share >= 0.95 else 'missed'} "
        f"| {new / max(best, 1e-9):.3f}x | {r['bound-4 s']:.0f} / {r['bound-roles s']:.0f} |"
    )


HEADER = (
    "| trace | column | rate | goodput ll / split | fs-all | four-shape bound (fs-all share) "
    "| role-count bound (fs-all share, >= 0.95) | role-count bound / best of ll, split "
    "| bound wall s (4 / roles) |\n|---|---|---|---|---|---|---|---|---|"
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="azure-0-30,mooncake-0-30")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--minutes", type=float, default=10.0, help="each trace this long (0: whole)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for name in args.traces.split(","):
        for rate in (float(x) for x in args.rates.split(",")):
            rows.append(run(name, rate, args.minutes))
            print(rows[-1], flush=True)
    print()
    print(HEADER)
    for r in rows:
        print(line(r))
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
