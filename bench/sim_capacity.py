"""Capacity planning, Splitwise-style: the cheapest fleet of DGX machines meeting the SLO.

For the conversation trace at 1x, 2x and 4x its rate, and per policy, the smallest fleet (then
the cheapest) of DGX-A100 / DGX-H100 / DGX-H200 machines (Llama-2-70B, TP 8, one instance per
machine) whose P99 TTFT <= 6x and P99 TBT <= 5x the unloaded times on a DGX-A100 (fixed
reference, so fleets are judged alike). Fleet families searched: all-A100, all-H100,
all-H200, and for the phase-splitting policies half H100 + half H200 and half A100 + half
H200 (the larger half on the second kind). To keep the search to minutes on a laptop CPU it
replays the first ``--minutes`` of the trace.

    .venv/bin/python bench/sim_capacity.py [--minutes 20] [--out /tmp/fleetshift-capacity.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fleetshift_daemon.core.perfmodel import Dtype, llama2_70b
from fleetshift_daemon.sim.fleet import NodeGroup, SimFleet, SloRule
from fleetshift_daemon.sim.metrics import billed_dollars
from fleetshift_daemon.sim.runner import run_policies
from fleetshift_daemon.sim.trace import Trace, load_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
A, H, G = "A100-SXM-80GB", "H100-SXM", "H200-SXM"
SLO = SloRule(6.0, 5.0, reference_gpu=A)
console = Console(width=200)
SPLITTING = ("split", "fleetshift", "fleetshift-all")


def fleet_of(counts: dict[str, int]) -> SimFleet:
    groups = tuple(NodeGroup(k, n, 8, 8) for k, n in counts.items() if n > 0)
    return SimFleet(llama2_70b(), Dtype.BF16, groups, slo=SLO)


def family(name: str, n: int) -> dict[str, int]:
    if name in (A, H, G):
        return {name: n}
    first, second = name.split("+")
    return {first: n // 2, second: n - n // 2}


def meets(trace: Trace, counts: dict[str, int], policy: str) -> tuple[bool, float, float, float]:
    """SLO met?, p99 slowdowns, and the $/hour actually billed (FleetShift may switch off)."""
    result = run_policies(fleet_of(counts), trace, [policy])[0]
    s = result.summary
    billed = billed_dollars(result.sim) / (s.makespan_s / 3600.0)
    return s.meets_p99_slo(), s.ttft_slowdown_p99, s.tbt_slowdown_p99, billed


def smallest(
    trace: Trace, fam: str, policy: str, start: int, limit: int = 40
) -> tuple[int, float] | None:
    n = start
    bills: list[float] = []
    while n <= limit:
        counts = family(fam, n)
        if "+" in fam and min(counts.values()) == 0:
            n += 1
            continue
        ok, t, b, billed = meets(trace, counts, policy)
        console.print(
            f"  {policy:14s} {fam:28s} n={n:2d}: p99 x{t:.1f}/x{b:.1f} billed ${billed:.1f}/h "
            f"{'ok' if ok else '-'}"
        )
        if ok:
            return n, billed
        bills.append(billed)
        if len(bills) >= 3 and max(bills[-3:]) <= min(bills[-3:]) * 1.02:
            # a policy that switches instances off left the last machines off: more will not help
            console.print(f"  {policy:14s} {fam:28s} stops: the extra machines stay off")
            return None
        n += 1
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/fleetshift-capacity.json"))
    ap.add_argument("--policies", default="rr,ll,split,fleetshift,fleetshift-all")
    args = ap.parse_args()
    base = load_trace(TRACE)
    base = base.window(0.0, args.minutes * 60.0)
    policies = args.policies.split(",")
    families = {
        p: [A, H, G] + ([f"{H}+{G}", f"{A}+{G}"] if p in SPLITTING else []) for p in policies
    }
    price = {k.name: k.price_per_hour for k in fleet_of({A: 1, H: 1, G: 1}).gpu_kinds()}
    results = []
    start: dict[tuple[str, str], int] = {}
    for scale in (1.0, 2.0, 4.0):
        trace = base.rate_scaled(scale, seed=0)
        console.print(f"x{scale:g}: {len(trace)} requests")
        for p in policies:
            for fam in families[p]:
                n0 = start.get((p, fam), 2 if "+" in fam or p == "split" else 1)
                found = smallest(trace, fam, p, n0)
                if found is None:
                    continue
                n, billed = found
                start[(p, fam)] = n
                counts = family(fam, n)
                cost = sum(8 * price[k] * c for k, c in counts.items())
                results.append(
                    {
                        "scale": scale,
                        "policy": p,
                        "family": fam,
                        "machines": n,
                        "counts": counts,
                        "usd_per_hour": cost,
                        "billed_usd_per_hour": billed,
                    }
                )
    table = Table(
        title=f"Cheapest fleet with P99 TTFT<=6x, TBT<=5x (first {args.minutes:g} min of the trace)"
    )
    cols = ("rate", "policy", "cheapest fleet", "machines", "$/hour", "billed $/hour", "vs rr/ll")
    for col in cols:
        table.add_column(col)
    for scale in (1.0, 2.0, 4.0):
        rows = [r for r in results if r["scale"] == scale]
        best = {}
        for r in rows:
            if r["policy"] not in best or (r["usd_per_hour"], r["machines"]) < (
                best[r["policy"]]["usd_per_hour"],
                best[r["policy"]]["machines"],
            ):
                best[r["policy"]] = r
        base_cost = min((best[p]["usd_per_hour"] for p in ("rr", "ll") if p in best), default=None)
        for p, r in best.items():
            fleet = " + ".join(f"{c}x {k}" for k, c in r["counts"].items() if c)
            rel = f"{r['usd_per_hour'] / base_cost:.2f}" if base_cost else "-"
            table.add_row(
                f"x{scale:g}",
                p,
                fleet,
                str(r["machines"]),
                f"{r['usd_per_hour']:.1f}",
                f"{r['billed_usd_per_hour']:.1f}",
                rel,
            )
    console.print(table)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
