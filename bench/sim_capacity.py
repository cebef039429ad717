"""Capacity planning, Splitwise-style: the cheapest fleet meeting the P99 SLO, per design.

Defaults are Splitwise's settings for the comparison of issue 11: the Azure conversation
trace, Llama-2-70B at TP 8 (one instance per DGX), DGX-A100 at 2.21 and DGX-H100 at 4.76 per
machine-hour, the trace time-compressed x1 / x2 / x4 (the same requests arriving 2x, 4x as
fast), and the P99 criterion TTFT slowdown <= 6, TBT slowdown <= 5 against an idle DGX-A100.
It prints, per rate, the cheapest passing fleet of each static design (Baseline-<kind>:
colocated, least-loaded; Splitwise-XY: X prompt machines, Y token machines, pools fixed)
beside the figures of Splitwise's own simulator at these settings, and the cheapest fleet
each dynamic policy (``fleetshift``, ``fleetshift-all``) needs on the kinds given, against the
cheapest static design.

    .venv/bin/python bench/sim_capacity.py                       # Splitwise's settings
    .venv/bin/python bench/sim_capacity.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --model llama31-70b --splits none                        # another trace
    .venv/bin/python bench/sim_capacity.py --scaling copies --kinds A100-SXM-80GB,H100-SXM,H200-SXM \\
        --prices catalogue                                       # k-copies scaling, catalogue prices

``--scaling copies`` is the earlier scaling (every request replayed k times, k-times taller
bursts). ``--minutes`` (default 20, to keep the search to minutes) replays only the first
minutes of the trace, before scaling; ``--minutes 0`` the whole trace.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.perfmodel import CONTEXT_WINDOWS, PRESETS
from fleetshift_daemon.sim.capacity import (
    Design,
    Search,
    Setting,
    Trier,
    search_design,
    search_dynamic,
    short,
)
from fleetshift_daemon.sim.fleet import SloRule
from fleetshift_daemon.sim.trace import Trace, fit_context, load_trace

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
CONV = SHARED / "azure_llm_2023_conv.csv"
A, H = "A100-SXM-80GB", "H100-SXM"
SPLITWISE_PRICES = {A: 2.21, H: 4.76}
# Splitwise's own simulator at these settings (issue 11): cheapest passing machine counts.
SPLITWISE = {
    "Baseline-A100": {1.0: ((A, 4),), 2.0: ((A, 6),), 4.0: ((A, 10),)},
    "Baseline-H100": {1.0: ((H, 2),), 2.0: ((H, 3),), 4.0: ((H, 5),)},
    "Splitwise-HA": {1.0: ((H, 2), (A, 1)), 2.0: ((H, 3), (A, 1)), 4.0: ((H, 6), (A, 1))},
    "Splitwise-HH": {1.0: ((H, 2), (H, 1)), 2.0: ((H, 3), (H, 1)), 4.0: ((H, 5), (H, 1))},
}
AGREEMENT = 0.2  # the target: within 20 % in machine count
DYNAMIC_TARGET = 0.8  # dynamic placement needs <= 0.8x the cheapest static design's cost
console = Console(width=200)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=CONV, help="Azure CSV or Mooncake JSONL")
    ap.add_argument("--model", default="llama2-70b", choices=sorted(PRESETS))
    ap.add_argument("--scaling", default="time-compress", choices=("time-compress", "copies"))
    ap.add_argument("--rates", default="1,2,4", help="comma list of rate factors")
    ap.add_argument("--kinds", default=f"{A},{H}", help="machine kinds (8 GPUs each)")
    ap.add_argument(
        "--prices",
        default=",".join(f"{k}={p}" for k, p in SPLITWISE_PRICES.items()),
        help="KIND=PRICE per machine-hour, comma separated, or 'catalogue' (8 x $/GPU-hour)",
    )
    ap.add_argument(
        "--splits",
        default=f"{H}/{A},{H}/{H}",
        help="PROMPT_KIND/TOKEN_KIND split designs, comma separated, or 'none'",
    )
    ap.add_argument("--dynamic", default="fleetshift,fleetshift-all", help="or 'none'")
    ap.add_argument(
        "--minutes", type=float, default=20.0, help="first minutes only, before scaling (0: all)"
    )
    ap.add_argument("--context-window", default="replay", choices=("replay", "model"))
    ap.add_argument("--slo-reference", default=A, help="the idle machine kind SLOs are against")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--out", type=Path, default=Path("/tmp/fleetshift-capacity.json"))
    args = ap.parse_args(argv)
    args.rate_list = [float(r) for r in args.rates.split(",") if r.strip()]
    args.kind_list = [k.strip() for k in args.kinds.split(",") if k.strip()]
    catalogue = default_catalogue()
    for kind in args.kind_list:
        catalogue.get(kind)  # an unknown kind fails here, naming the known ones
    args.price_map = parse_prices(args.prices, args.kind_list)
    args.split_list = parse_splits(args.splits, args.kind_list)
    args.dynamic_list = [] if args.dynamic == "none" else args.dynamic.split(",")
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        ap.error("--rates must be positive numbers")
    return args


def parse_prices(spec: str, kinds: Sequence[str]) -> dict[str, float]:
    if spec == "catalogue":
        cat = default_catalogue()
        return {k: 8 * cat.get(k).price_per_hour for k in kinds}
    prices: dict[str, float] = {}
    for item in spec.split(","):
        kind, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--prices: {item!r} is not KIND=PRICE")
        prices[kind.strip()] = float(value)
    missing = [k for k in kinds if k not in prices]
    if missing:
        raise SystemExit(f"--prices: no price for {missing[0]}")
    return prices


def parse_splits(spec: str, kinds: Sequence[str]) -> list[Design]:
    if spec == "none":
        return []
    designs = []
    for item in spec.split(","):
        prompt, sep, token = item.partition("/")
        if not sep or prompt not in kinds or token not in kinds:
            raise SystemExit(f"--splits: {item!r} is not PROMPT/TOKEN of the --kinds")
        designs.append(Design(prompt, token))
    return designs


def splitwise_settings(args: argparse.Namespace) -> bool:
    """The settings Splitwise's figures were measured at (so the comparison means something)."""
    return (
        args.trace.resolve() == CONV.resolve()
        and args.model == "llama2-70b"
        and args.scaling == "time-compress"
        and all(args.price_map.get(k) == p for k, p in SPLITWISE_PRICES.items())
        and args.slo_reference == A
    )


@functools.cache
def base_trace(path: str, minutes: float, model: str, window: str) -> Trace:
    trace = load_trace(path)
    if minutes > 0:
        trace = trace.window(0.0, minutes * 60.0)
    if window == "model":
        trace = fit_context(trace, CONTEXT_WINDOWS[model]).trace
    return trace


def scaled(trace: Trace, scaling: str, rate: float) -> Trace:
    if scaling == "time-compress":
        return trace.time_compressed(rate)
    return trace.rate_scaled(rate, seed=0)


def run_task(task: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """One search (a design or a dynamic family, one rate) in a worker process."""
    trace = scaled(
        base_trace(task["trace"], task["minutes"], task["model"], task["window"]),
        task["scaling"],
        task["rate"],
    )
    setting = Setting(task["model"], task["prices"], SloRule(6.0, 5.0, task["reference"]))
    trier = Trier(trace, setting)
    lines: list[str] = []
    if task["kind"] == "design":
        found: Search = search_design(trier, Design(*task["design"]), task["rate"], lines.append)
    else:
        found = search_dynamic(trier, task["policy"], task["family"], task["rate"], lines.append)
    out = found.as_dict()
    out.update(kind=task["kind"], requests=len(trace))
    return out, lines


def tasks_for(args: argparse.Namespace) -> list[dict[str, Any]]:
    common = {
        "trace": str(args.trace),
        "minutes": args.minutes,
        "model": args.model,
        "window": args.context_window,
        "scaling": args.scaling,
        "prices": args.price_map,
        "reference": args.slo_reference,
    }
    designs = [Design(k) for k in args.kind_list] + args.split_list
    families = [[k] for k in args.kind_list]
    if len(args.kind_list) >= 2:
        families.append(args.kind_list[:2])
    tasks = []
    for rate in args.rate_list:
        for d in designs:
            tasks.append(
                {
                    **common,
                    "rate": rate,
                    "kind": "design",
                    "design": (d.prefill_kind, d.decode_kind),
                }
            )
        for policy in args.dynamic_list:
            for fam in families:
                tasks.append(
                    {**common, "rate": rate, "kind": "dynamic", "policy": policy, "family": fam}
                )
    return tasks


def run_all(tasks: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    results = []
    if jobs <= 1:
        for task in tasks:
            res, lines = run_task(task)
            for line in lines:
                console.print(line)
            results.append(res)
        return results
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for res, lines in pool.map(run_task, tasks):
            for line in lines:
                console.print(line)
            results.append(res)
    return results


def fleet_text(counts: Sequence[Sequence[Any]], split: bool) -> str:
    """``2H+1A`` for a split (prompt first; ``2+1`` when both pools are one kind), else ``4 A``."""
    items = [(str(k), int(n)) for k, n in counts]
    if split and len(items) == 2:
        (pk, pn), (dk, dn) = items
        return f"{pn}{short(pk)}+{dn}{short(dk)}" if pk != dk else f"{pn}+{dn}"
    return " + ".join(f"{n} {short(k)}" for k, n in items)


def machines(counts: Sequence[Sequence[Any]]) -> int:
    return sum(int(n) for _, n in counts)


def design_table(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    compare = splitwise_settings(args)
    table = Table(title="Static designs: cheapest fleet meeting P99 TTFT <= 6x, TBT <= 5x")
    for col in ("rate", "design", "ours", "machines", "$/hour", "p99 TTFT / TBT slowdown",
                "Splitwise's sim", "ratio (ours / theirs)", "within 20 %"):  # fmt: skip
        table.add_column(col)
    rows = []
    for r in (x for x in results if x["kind"] == "design"):
        best = r["best"]
        split = r["label"].startswith("Splitwise-")
        ref = SPLITWISE.get(r["label"], {}).get(r["rate"]) if compare else None
        ours = fleet_text(best["counts"], split) if best else "none passed"
        theirs = fleet_text(ref, split) if ref else "-"
        ratio = machines(best["counts"]) / machines(ref) if (ref and best) else None
        ok = None if ratio is None else abs(ratio - 1.0) <= AGREEMENT
        rows.append({"rate": r["rate"], "design": r["label"], "ours": ours, "theirs": theirs,
                     "ratio": ratio, "within": ok,
                     "usd_per_hour": best["usd_per_hour"] if best else None})  # fmt: skip
        table.add_row(
            f"x{r['rate']:g}",
            r["label"],
            ours,
            str(machines(best["counts"])) if best else "-",
            f"{best['usd_per_hour']:.2f}" if best else "-",
            f"{best['ttft_slowdown_p99']:.2f} / {best['tbt_slowdown_p99']:.2f}" if best else "-",
            theirs,
            f"{ratio:.2f}" if ratio is not None else "-",
            {None: "-", True: "met", False: "missed"}[ok],
        )
    console.print(table)
    if not compare:
        console.print("Splitwise's figures apply to the default settings only: not compared.")
    return rows


def dynamic_table(results: list[dict[str, Any]], rates: Sequence[float]) -> list[dict[str, Any]]:
    table = Table(title="Dynamic placement against the cheapest static design (target <= 0.8x)")
    for col in ("rate", "policy on kinds", "fleet", "$/hour provisioned", "$/hour billed",
                "cheapest static", "billed / static", "<= 0.8x"):  # fmt: skip
        table.add_column(col)
    rows = []
    for rate in rates:
        statics = [r for r in results if r["kind"] == "design" and r["rate"] == rate and r["best"]]
        cheapest = min(statics, key=lambda r: r["best"]["usd_per_hour"], default=None)
        for r in (x for x in results if x["kind"] == "dynamic" and x["rate"] == rate):
            best = r["best"]
            static = cheapest["best"]["usd_per_hour"] if cheapest else None
            ratio = best["billed_usd_per_hour"] / static if (best and static) else None
            rows.append({"rate": rate, "label": r["label"], "ratio": ratio,
                         "billed": best["billed_usd_per_hour"] if best else None,
                         "static": static, "met": ratio is not None and ratio <= DYNAMIC_TARGET})  # fmt: skip
            table.add_row(
                f"x{rate:g}",
                r["label"],
                fleet_text(best["counts"], False) if best else "none passed",
                f"{best['usd_per_hour']:.2f}" if best else "-",
                f"{best['billed_usd_per_hour']:.2f}" if best else "-",
                f"{cheapest['label']} {static:.2f}" if cheapest and static else "-",
                f"{ratio:.2f}" if ratio is not None else "-",
                "met" if ratio is not None and ratio <= DYNAMIC_TARGET else "missed",
            )
    console.print(table)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    trace = base_trace(str(args.trace), args.minutes, args.model, args.context_window)
    console.print(
        f"{args.trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, {args.model}, "
        f"{args.scaling} x{'/x'.join(f'{r:g}' for r in args.rate_list)}, prices "
        + ", ".join(f"{short(k)} {p:g}" for k, p in args.price_map.items())
        + " per machine-hour"
    )
    results = run_all(tasks_for(args), args.jobs)
    designs = design_table(args, results)
    dynamic = dynamic_table(results, args.rate_list) if args.dynamic_list else []
    wall = time.perf_counter() - t0
    console.print(f"wall {wall:.0f} s")
    meta = {k: v for k, v in vars(args).items() if k not in ("out",)}
    meta = json.loads(json.dumps(meta, default=str))
    doc = {
        "meta": meta,
        "wall_s": wall,
        "designs": designs,
        "dynamic": dynamic,
        "searches": results,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
