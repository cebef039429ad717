"""FleetShift's own policies on chosen validation cells, one JSON line per run.

``bench/sim_issue11.py`` runs ``ll`` and ``split`` beside them for the issue's verdicts; a
change to the daemon's placement only moves ``fleetshift`` and ``fleetshift-all``, so this
runs just those (about half the time on two shared cores). Before/after: run it once from
this tree and once with ``PYTHONPATH`` on a ``git archive`` of the base commit's ``daemon``
and ``common`` (the first line says which code ran)::

    git archive <base> daemon common | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/daemon:/tmp/base/common .venv/bin/python bench/sim_fleetshift_cells.py \
        mooncake-0-30:4,tuning-m-then-a:2 --minutes 10 --jobs 2

``--planner NAME=VALUE`` (repeatable) replays the policies with one of the planner's settings
changed, e.g. ``--planner mixed_efficiency=0.85`` for the value before Round 12b, from the
same tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import fleetshift_daemon
from fleetshift_daemon.core.planner import PlannerConfig
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.runner import RunOptions, run_policies
from fleetshift_daemon.sim.validation import validation_traces

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"


def planner_config(settings: Sequence[str]) -> PlannerConfig | None:
    """``PlannerConfig`` with each ``NAME=VALUE`` of ``settings`` (floats), or None."""
    if not settings:
        return None
    known = {f.name for f in dataclasses.fields(PlannerConfig)}
    changed: dict[str, float | int] = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in known or not value:
            raise SystemExit(f"--planner {setting!r}: want NAME=VALUE, NAME one of {sorted(known)}")
        changed[name] = int(value) if value.lstrip("-").isdigit() else float(value)
    return PlannerConfig(**changed)  # type: ignore[arg-type]


def run(
    task: tuple[str, float, float, tuple[str, ...], PlannerConfig | None],
) -> list[dict[str, Any]]:
    name, rate, minutes, policies, planner = task
    v = validation_traces(
        SHARED / "azure_llm_2023_conv.csv",
        SHARED / "mooncake_conversation_trace.jsonl",
        (name,),
        span_s=minutes * 60.0 if minutes > 0 else None,
    )[0].compressed(rate)
    out = []
    for policy in policies:
        t0 = time.perf_counter()
        opts = RunOptions(planner=planner)
        s = run_policies(standard_fleet(preset=v.model), v.trace, [policy], opts)[0]
        out.append(
            {
                "trace": name,
                "rate": rate,
                "column": "tuning" if v.tuning else "held out",
                "policy": policy,
                "goodput": round(s.summary.goodput_rps, 3),
                "slo": round(s.summary.slo_attainment, 4),
                "usd_per_mtok": round(s.summary.cost_per_mtok, 3),
                "moves": s.summary.move_count,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cells", help="trace:rate,... e.g. mooncake-0-30:4,azure-0-30:2")
    ap.add_argument("--policies", default="fleetshift-all,fleetshift")
    ap.add_argument("--minutes", type=float, default=10.0, help="each trace this long (0: whole)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--planner", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args(argv)
    planner = planner_config(args.planner)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    tasks = []
    for cell in args.cells.split(","):
        name, rate = cell.strip().split(":")
        tasks.append((name, float(rate), args.minutes, policies, planner))
    print(f"# code: {Path(fleetshift_daemon.__file__).parent}; planner: {args.planner}", flush=True)
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        for rows in pool.map(run, tasks) if args.jobs > 1 else map(run, tasks):
            for row in rows:
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
