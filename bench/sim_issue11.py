"""Issue 11's policy targets, quickly: ll, split, fleetshift, fleetshift-all on the validation set.

The full suite (``bench/sim_validation.py``) also runs the hindsight bound and the capacity
searches, which take hours on two shared cores; this bench runs the four deployable policies
only, so the targets that compare them with each other can be checked after every change:

* ``fleetshift`` SLO attainment at most 1 point below ``ll``'s, and $/M tokens >= 20 % below
  ``ll``'s where the offered load needs at most half the fleet (by the perf model);
* ``fleetshift-all`` goodput >= the better of ``ll`` and ``split``; on service shifts, >= 1.2x
  ``split`` in the half after the switch (split's pools were sized on the first minutes);
* with ``--oracle``, ``fleetshift-all`` goodput within 5 % of the hindsight bound
  (``sim.oracle``: per 5-minute window, the best of the candidate placements on the window's
  real arrivals, moved to for free). It runs each window several times over, so it is off
  by default.

Traces come from ``sim.validation`` (tuning rows: Azure and Mooncake minutes 0-30 and the
shifts built from them; everything else held out); rates are Splitwise's time compression.
One line per run, then a markdown table::

    .venv/bin/python bench/sim_issue11.py --minutes 10 --rates 1,2,4 --jobs 1 [--oracle]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from fleetshift_daemon.sim.engine import Simulator
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.metrics import outcomes
from fleetshift_daemon.sim.policies import decode_rate, observed_mix, prefill_rate
from fleetshift_daemon.sim.runner import RunOptions, run_policies
from fleetshift_daemon.sim.validation import TRACE_NAMES, validation_traces

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
POLICIES = ("ll", "split", "fleetshift", "fleetshift-all")
KEYS = (
    "fs SLO vs ll",
    "fs $/M vs ll",
    "fs-all goodput vs best of ll/split",
    "fs-all / split after the switch",
    "moves fs / fs-all",
)
ORACLE_KEY = "fs-all goodput vs hindsight bound"


def offered_load(sim: Simulator) -> float:
    """Share of the fleet the whole trace's mean mix needs, colocated (perf model)."""
    mix = observed_mix(sim, 0.0, max(sim.trace.duration_s, 1e-9))
    cfg = sim.config
    pre = sum(
        prefill_rate(i.timer, mix.mean_prompt, cfg.prefill_token_budget) for i in sim.instances
    )
    dec = sum(decode_rate(i.timer, i.kv_cap, mix, cfg.max_batch) for i in sim.instances)
    return mix.rate_per_s * (mix.mean_prompt / pre + mix.mean_output / dec)


def run(task: tuple[str, float, float, bool]) -> dict[str, Any]:
    name, rate, minutes, oracle = task
    v = next(
        t
        for t in validation_traces(
            SHARED / "azure_llm_2023_conv.csv",
            SHARED / "mooncake_conversation_trace.jsonl",
            (name,),
            span_s=minutes * 60.0 if minutes > 0 else None,
        )
    ).compressed(rate)
    t0 = time.perf_counter()
    names = POLICIES + (("oracle",) if oracle else ())
    results = run_policies(standard_fleet(preset=v.model), v.trace, names, RunOptions())
    out: dict[str, Any] = {"trace": name, "rate": rate, "tuning": v.tuning, "wall_s": 0.0}
    for r in results:
        s = r.summary
        row = {"goodput": s.goodput_rps, "slo": s.slo_attainment, "usd": s.cost_per_mtok}
        row["moves"] = s.move_count
        if v.switch_s is not None:
            ok = outcomes(r.sim).slo_ok
            after = v.trace.arrival_s >= v.switch_s
            row["after"] = float(ok[after].sum()) / max(v.trace.duration_s - v.switch_s, 1e-9)
        out[r.name] = row
    out["load"] = offered_load(results[0].sim)
    out["wall_s"] = time.perf_counter() - t0
    return out


def verdicts(r: dict[str, Any]) -> dict[str, str]:
    ll, split, fs, fa = (r[p] for p in POLICIES)
    slo_ok = fs["slo"] >= ll["slo"] - 0.01
    cost_cut = 1 - fs["usd"] / ll["usd"]
    cost = "n/a (load > 1/2)" if r["load"] > 0.5 else ("met" if cost_cut >= 0.2 else "missed")
    better = max(ll["goodput"], split["goodput"])
    good_ok = fa["goodput"] >= better * (1 - 1e-3)  # 0.1 %: the sim's own run-to-run noise
    out = {
        "fs SLO vs ll": f"{fs['slo']:.2%} vs {ll['slo']:.2%} {'met' if slo_ok else 'missed'}",
        "fs $/M vs ll": f"{fs['usd']:.2f} vs {ll['usd']:.2f} ({-cost_cut:+.0%}) {cost}",
        "fs-all goodput vs best of ll/split": (
            f"{fa['goodput']:.2f} vs {better:.2f} ({fa['goodput'] / better:.3f}x) "
            f"{'met' if good_ok else 'missed'}"
        ),
    }
    if "after" in fa:
        gain = fa["after"] / max(split["after"], 1e-9)
        out["fs-all / split after the switch"] = f"{gain:.2f}x {'met' if gain >= 1.2 else 'missed'}"
    out["moves fs / fs-all"] = f"{fs['moves']} / {fa['moves']}"
    if "oracle" in r:
        bound = r["oracle"]["goodput"]
        share = fa["goodput"] / max(bound, 1e-9)
        out[ORACLE_KEY] = (
            f"{fa['goodput']:.2f} vs {bound:.2f} ({share:.3f}x) "
            f"{'met' if share >= 0.95 else 'missed'}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(TRACE_NAMES))
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--minutes", type=float, default=10.0, help="each trace this long (0: whole)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--oracle", action="store_true", help="add the hindsight bound (slow)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.traces.split(",") if n.strip()]
    tasks = [(n, float(x), args.minutes, args.oracle) for n in names for x in args.rates.split(",")]
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        for r in pool.map(run, tasks) if args.jobs > 1 else map(run, tasks):
            rows.append(r)  # printed as each run ends, so a cut-short run still leaves lines
            print(f"{r['trace']} x{r['rate']:g} ({r['wall_s']:.0f} s): {r}", flush=True)
    keys = KEYS + ((ORACLE_KEY,) if args.oracle else ())
    print()
    print("| trace | column | rate | load | " + " | ".join(keys) + " |")
    print("|---|---|---|---:|" + "---|" * len(keys))
    for r in sorted(rows, key=lambda r: (not r["tuning"], names.index(r["trace"]), r["rate"])):
        v = verdicts(r)
        col = "tuning" if r["tuning"] else "held out"
        cells = " | ".join(v.get(k, "-") for k in keys)
        print(f"| {r['trace']} | {col} | x{r['rate']:g} | {r['load']:.2f} | {cells} |")
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
