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
from fleetshift_daemon.sim.mixed_pool import MixedPoolSplit
from fleetshift_daemon.sim.policies import FixedSplit
from fleetshift_daemon.sim.trace import Trace, fit_context, load_trace
from fleetshift_daemon.sim.validation import TRACE_NAMES, ValidationTrace, validation_traces

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
CONV = SHARED / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "mooncake_conversation_trace.jsonl"
A, H = "A100-SXM-80GB", "H100-SXM"
SPLITWISE_PRICES = {A: 2.21, H: 4.76}
# Splitwise's own simulator at these settings (issue 11): cheapest passing machine counts.
SPLITWISE = {
    "Baseline-A100": {1.0: ((A, 4),), 2.0: ((A, 6),), 4.0: ((A, 10),)},
    "Baseline-H100": {1.0: ((H, 2),), 2.0: ((H, 3),), 4.0: ((H, 5),)},
    "Splitwise-HA": {1.0: ((H, 2), (A, 1)), 2.0: ((H, 3), (A, 1)), 4.0: ((H, 6), (A, 1))},
    "Splitwise-HH": {1.0: ((H, 2), (H, 1)), 2.0: ((H, 3), (H, 1)), 4.0: ((H, 5), (H, 1))},
}
SPLIT_POLICIES = {"mixed-pool": MixedPoolSplit, "fixed": FixedSplit}
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
    ap.add_argument(
        "--split-policy",
        default="mixed-pool",
        choices=sorted(SPLIT_POLICIES),
        help="how a split design schedules: Splitwise's mixed pool, or pools that never lend",
    )
    ap.add_argument("--dynamic", default="fleetshift,fleetshift-all", help="or 'none'")
    ap.add_argument(
        "--families",
        default="each",
        help="fleets the dynamic policies get: 'each' (every kind alone, and the first two "
        "half and half) or KIND[+KIND] items, comma separated",
    )
    ap.add_argument(
        "--minutes", type=float, default=20.0, help="first minutes only, before scaling (0: all)"
    )
    ap.add_argument("--context-window", default="replay", choices=("replay", "model"))
    ap.add_argument(
        "--validation",
        default="none",
        help="issue 11's validation traces instead of --trace (comma list, or 'all'); each "
        "brings its own model (Llama-3.1-70B where Mooncake is in it); --minutes is the span",
    )
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
    args.validation_list = parse_validation(args.validation)
    args.family_list = parse_families(args.families, args.kind_list)
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        ap.error("--rates must be positive numbers")
    return args


def parse_families(spec: str, kinds: Sequence[str]) -> list[list[str]]:
    if spec == "each":
        return [[k] for k in kinds] + ([list(kinds[:2])] if len(kinds) >= 2 else [])
    families = [[k.strip() for k in item.split("+")] for item in spec.split(",")]
    for fam in families:
        if not 1 <= len(fam) <= 2 or any(k not in kinds for k in fam):
            raise SystemExit(f"--families: {'+'.join(fam)!r} is not one or two of the --kinds")
    return families


def parse_validation(spec: str) -> list[str]:
    if spec == "none":
        return []
    names = list(TRACE_NAMES) if spec == "all" else [n.strip() for n in spec.split(",")]
    unknown = [n for n in names if n not in TRACE_NAMES]
    if unknown:
        raise SystemExit(
            f"--validation: unknown trace {unknown[0]!r} (known: all, {', '.join(TRACE_NAMES)})"
        )
    return names


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
        not args.validation_list
        and args.trace.resolve() == CONV.resolve()
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


@functools.cache
def validation_trace(name: str, minutes: float) -> ValidationTrace:
    """One trace of issue 11's validation set, each source window cut to ``minutes``."""
    span = minutes * 60.0 if minutes > 0 else None
    return validation_traces(CONV, MOONCAKE, (name,), seed=0, span_s=span)[0]


def source_trace(task: dict[str, Any]) -> Trace:
    if task["validation"]:
        return validation_trace(task["validation"], task["minutes"]).trace
    return base_trace(task["trace"], task["minutes"], task["model"], task["window"])


def scaled(trace: Trace, scaling: str, rate: float) -> Trace:
    if scaling == "time-compress":
        return trace.time_compressed(rate)
    return trace.rate_scaled(rate, seed=0)


def run_task(task: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """One search (a design or a dynamic family, one rate) in a worker process."""
    trace = scaled(source_trace(task), task["scaling"], task["rate"])
    setting = Setting(task["model"], task["prices"], SloRule(6.0, 5.0, task["reference"]))
    trier = Trier(trace, setting)
    lines: list[str] = []
    if task["kind"] == "design":
        split = SPLIT_POLICIES[task["split_policy"]]
        found: Search = search_design(
            trier, Design(*task["design"]), task["rate"], lines.append, split
        )
    else:
        found = search_dynamic(trier, task["policy"], task["family"], task["rate"], lines.append)
    out = found.as_dict()
    out.update(
        kind=task["kind"],
        source=task["validation"] or Path(task["trace"]).name,
        requests=len(trace),
        duration_s=trace.duration_s,
    )
    return out, lines


def sources(args: argparse.Namespace) -> list[tuple[str | None, str]]:
    """(validation trace name or None for --trace, model) per trace the bench searches."""
    if not args.validation_list:
        return [(None, args.model)]
    return [(n, validation_trace(n, args.minutes).model) for n in args.validation_list]


def tasks_for(args: argparse.Namespace) -> list[dict[str, Any]]:
    designs = [Design(k) for k in args.kind_list] + args.split_list
    families = args.family_list
    tasks = []
    for name, model in sources(args):
        common = {
            "trace": str(args.trace),
            "validation": name,
            "minutes": args.minutes,
            "model": model,
            "window": args.context_window,
            "scaling": args.scaling,
            "prices": args.price_map,
            "reference": args.slo_reference,
            "split_policy": args.split_policy,
        }
        for rate in args.rate_list:
            for d in designs:
                design = (d.prefill_kind, d.decode_kind)
                tasks.append({**common, "rate": rate, "kind": "design", "design": design})
            for policy in args.dynamic_list:
                for fam in families:
                    tasks.append(
                        {**common, "rate": rate, "kind": "dynamic", "policy": policy,
                         "family": fam}
                    )  # fmt: skip
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
    table = Table(
        title="Static designs: cheapest fleet meeting P99 TTFT <= 6x, TBT <= 5x "
        f"(splits scheduled as {args.split_policy})"
    )
    for col in ("trace", "rate", "design", "ours", "machines", "$/hour",
                "p99 TTFT / TBT slowdown", "Splitwise's sim", "ratio (ours / theirs)",
                "within 20 %"):  # fmt: skip
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
        rows.append({"source": r["source"], "rate": r["rate"], "design": r["label"],
                     "ours": ours, "theirs": theirs, "ratio": ratio, "within": ok,
                     "usd_per_hour": best["usd_per_hour"] if best else None})  # fmt: skip
        table.add_row(
            r["source"],
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
    if compare:
        met = sum(1 for row in rows if row["within"])
        console.print(f"Within 20 % of Splitwise's simulator: {met} of {len(rows)}")
    else:
        console.print("Splitwise's figures apply to the default settings only: not compared.")
    return rows


def dynamic_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = Table(title="Dynamic placement against the cheapest static design (target <= 0.8x)")
    for col in ("trace", "rate", "policy on kinds", "fleet", "$/hour provisioned",
                "$/hour billed", "cheapest static", "billed / static", "<= 0.8x"):  # fmt: skip
        table.add_column(col)
    rows = []
    keys = dict.fromkeys((r["source"], r["rate"]) for r in results)
    for source, rate in keys:
        mine = [r for r in results if r["source"] == source and r["rate"] == rate]
        statics = [r for r in mine if r["kind"] == "design" and r["best"]]
        cheapest = min(statics, key=lambda r: r["best"]["usd_per_hour"], default=None)
        static = cheapest["best"]["usd_per_hour"] if cheapest else None
        for r in (x for x in mine if x["kind"] == "dynamic"):
            best = r["best"]
            ratio = best["billed_usd_per_hour"] / static if (best and static) else None
            met = ratio is not None and ratio <= DYNAMIC_TARGET
            rows.append({"source": source, "rate": rate, "label": r["label"], "ratio": ratio,
                         "billed": best["billed_usd_per_hour"] if best else None,
                         "static": static,
                         "static_design": cheapest["label"] if cheapest else None,
                         "met": met})  # fmt: skip
            table.add_row(
                source,
                f"x{rate:g}",
                r["label"],
                fleet_text(best["counts"], False) if best else "none passed",
                f"{best['usd_per_hour']:.2f}" if best else "-",
                f"{best['billed_usd_per_hour']:.2f}" if best else "-",
                f"{cheapest['label']} {static:.2f}" if cheapest and static else "-",
                f"{ratio:.2f}" if ratio is not None else "-",
                "met" if met else "missed",
            )
    console.print(table)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    for name, model in sources(args):
        trace = source_trace({"validation": name, "trace": str(args.trace),
                              "minutes": args.minutes, "model": model,
                              "window": args.context_window})  # fmt: skip
        console.print(
            f"{name or args.trace.name}: {len(trace)} requests over {trace.duration_s:.0f} s, "
            f"{model}, {args.scaling} x{'/x'.join(f'{r:g}' for r in args.rate_list)}, prices "
            + ", ".join(f"{short(k)} {p:g}" for k, p in args.price_map.items())
            + f" per machine-hour, splits scheduled as {args.split_policy}"
        )
    results = run_all(tasks_for(args), args.jobs)
    designs = design_table(args, results)
    dynamic = dynamic_table(results) if args.dynamic_list else []
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
