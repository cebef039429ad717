"""Issue 11's validation suite: every placement policy on every trace of the validation set.

Runs ``ll``, ``split``, ``fleetshift``, ``fleetshift-all`` and the hindsight bound (``oracle``)
on the 12-node benchmark fleet (4 DGX-A100, 4 DGX-H100, 4 DGX-H200, TP 8) over the traces of
``fleetshift_daemon.sim.validation`` at x1 / x2 / x4 (time compression: the same requests
arriving 2x, 4x as fast, as Splitwise scales), then a capacity search per trace at x1
(``sim.capacity``, Splitwise's prices and designs). It prints, and writes as markdown, one
table per property of issue 11's "What must hold", the tuning column (Azure minutes 0-30)
apart from the held-out columns, each cell met / missed.

    .venv/bin/python bench/sim_validation.py --doc docs/bench-sim-validation.md   # ~10 min, 2 cores
    .venv/bin/python bench/sim_validation.py --quick --out /tmp/val               # seconds: a smoke run

``--doc`` rewrites the results between the doc's ``<!-- results -->`` markers, with the
command, the date and the commit, so re-running it after a change is one command.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from fleetshift_daemon.sim.capacity import (
    Design,
    Setting,
    Trier,
    search_design,
    search_dynamic,
)
from fleetshift_daemon.sim.engine import Simulator
from fleetshift_daemon.sim.fleet import SloRule, standard_fleet
from fleetshift_daemon.sim.metrics import outcomes
from fleetshift_daemon.sim.policies import decode_rate, observed_mix, prefill_rate
from fleetshift_daemon.sim.runner import RunOptions, run_policies
from fleetshift_daemon.sim.validation import (
    SHIFT_NAMES,
    TRACE_NAMES,
    ValidationTrace,
    validation_traces,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared" / "traces"
AZURE = SHARED / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "mooncake_conversation_trace.jsonl"
POLICIES = ("ll", "split", "fleetshift", "fleetshift-all", "oracle")
RATES = (1.0, 2.0, 4.0)
A, H = "A100-SXM-80GB", "H100-SXM"
PRICES = {A: 2.21, H: 4.76}  # Splitwise's per machine-hour
DESIGNS = (Design(A), Design(H), Design(H, A), Design(H, H))
DYNAMIC = ("fleetshift", "fleetshift-all")
LOAD_ALLOWS = 0.5  # the cost target applies where the model says half the fleet would do
SLO_POINTS = 1.0
COST_CUT = 0.8
SPLIT_GAIN = 1.2
ORACLE_SHARE = 0.95
DYNAMIC_SHARE = 0.8
MARK = ("<!-- results -->", "<!-- /results -->")


@functools.cache
def _traces(seed: int, span_s: float) -> dict[str, ValidationTrace]:
    span = span_s if span_s > 0 else None
    return {v.name: v for v in validation_traces(AZURE, MOONCAKE, TRACE_NAMES, seed, span)}


def prepared(name: str, rate: float, span_s: float, seed: int) -> ValidationTrace:
    return _traces(seed, span_s)[name].compressed(rate)


def offered_load(sim: Simulator) -> float:
    """Model-estimated share of the fleet the offered load needs (colocated, whole trace)."""
    mix = observed_mix(sim, 0.0, max(sim.trace.duration_s, 1e-9))
    cfg = sim.config
    pre = sum(
        prefill_rate(i.timer, mix.mean_prompt, cfg.prefill_token_budget) for i in sim.instances
    )
    dec = sum(decode_rate(i.timer, i.kv_cap, mix, cfg.max_batch) for i in sim.instances)
    return mix.rate_per_s * (mix.mean_prompt / pre + mix.mean_output / dec)


def run_policy(task: dict[str, Any]) -> dict[str, Any]:
    v = prepared(task["trace"], task["rate"], task["span_s"], task["seed"])
    fleet = standard_fleet(preset=v.model)
    res = run_policies(fleet, v.trace, [task["policy"]], RunOptions(seed=task["seed"]))[0]
    s = res.summary
    out = {
        **task,
        "requests": s.requests,
        "over_window": v.over_window,
        "goodput_rps": s.goodput_rps,
        "slo_attainment": s.slo_attainment,
        "cost_per_mtok": s.cost_per_mtok,
        "ttft_slowdown_p99": s.ttft_slowdown_p99,
        "tbt_slowdown_p99": s.tbt_slowdown_p99,
        "moves": s.move_count,
        "dropped": s.dropped,
        "wall_s": s.sim_wall_s,
        "load": offered_load(res.sim),
    }
    if v.switch_s is not None:
        ok = outcomes(res.sim).slo_ok
        after = v.trace.arrival_s >= v.switch_s
        out["goodput_after_rps"] = float(ok[after].sum()) / max(
            v.trace.duration_s - v.switch_s, 1e-9
        )
        out["goodput_before_rps"] = float(ok[~after].sum()) / max(v.switch_s, 1e-9)
    return out


def run_capacity(task: dict[str, Any]) -> dict[str, Any]:
    v = prepared(task["trace"], 1.0, task["minutes"] * 60.0, task["seed"])
    setting = Setting(v.model, PRICES, SloRule(6.0, 5.0, A))
    trier = Trier(v.trace, setting)
    lines: list[str] = []
    if task["kind"] == "design":
        found = search_design(trier, Design(*task["design"]), 1.0, lines.append)
    else:
        found = search_dynamic(trier, task["policy"], [A, H], 1.0, lines.append)
    best = found.best
    return {
        **task,
        "label": found.label,
        "trials": len(found.trials),
        "counts": best.counts if best else None,
        "usd_per_hour": best.cost_per_h if best else None,
        "billed_usd_per_hour": best.billed_per_h if best else None,
        "log": lines,
    }


def run_all(
    tasks: list[dict[str, Any]], jobs: int, fn: Callable[[dict[str, Any]], dict[str, Any]]
) -> list[dict[str, Any]]:
    done: list[dict[str, Any]] = []

    def note(r: dict[str, Any]) -> None:
        done.append(r)
        what = r.get("policy") or r.get("label") or r.get("design")
        print(f"  [{len(done)}/{len(tasks)}] {r['trace']} x{r.get('rate', 1):g} {what}", flush=True)

    if jobs <= 1:
        for t in tasks:
            note(fn(t))
        return done
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for fut in as_completed([pool.submit(fn, t) for t in tasks]):
            note(fut.result())
    return done


# ----- tables --------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return {None: "n/a", True: "met", False: "**missed**"}[ok]


def by_key(results: list[dict[str, Any]]) -> dict[tuple[str, float, str], dict[str, Any]]:
    return {(r["trace"], r["rate"], r["policy"]): r for r in results}


Cell = Callable[[Callable[[str], dict[str, Any]]], tuple[str, bool | None]]


def property_table(
    title: str,
    names: Sequence[str],
    rates: Sequence[float],
    runs: dict[tuple[str, float, str], dict[str, Any]],
    cell: Cell,
) -> tuple[list[str], dict[str, int]]:
    """Rows = rates; first the tuning column, then the held-out columns; a tally of held-out."""
    traces = _traces(0, 60.0)  # which column a trace belongs to does not depend on its span
    tuning = [n for n in names if traces[n].tuning]
    held = [n for n in names if not traces[n].tuning]
    head = ["rate"] + [f"{n} (tuning)" for n in tuning] + ["‖"] + [f"{n} (held out)" for n in held]
    lines = [f"#### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tally = {"met": 0, "missed": 0, "n/a": 0}
    for rate in rates:
        row = [f"x{rate:g}"]
        for group in (tuning, held):
            for n in group:
                if not all((n, rate, p) in runs for p in POLICIES):
                    row.append("-")
                    continue
                text, ok = cell(functools.partial(_run_of, runs, n, rate))
                row.append(f"{text} {verdict(ok)}")
                if group is held:
                    tally[verdict(ok).strip("*")] += 1
            if group is tuning:
                row.append("‖")
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"Held out: met {tally['met']}, missed {tally['missed']}, not applicable {tally['n/a']}.",
        "",
    ]
    return lines, tally


def _run_of(
    runs: dict[tuple[str, float, str], dict[str, Any]], name: str, rate: float, policy: str
) -> dict[str, Any]:
    return runs[(name, rate, policy)]


def slo_cell(get: Callable[[str], dict[str, Any]]) -> tuple[str, bool | None]:
    ll, fs = get("ll")["slo_attainment"], get("fleetshift")["slo_attainment"]
    gap = 100 * (fs - ll)
    return f"{100 * fs:.1f} vs {100 * ll:.1f} % ({gap:+.1f} pt)", gap >= -SLO_POINTS


def cost_cell(get: Callable[[str], dict[str, Any]]) -> tuple[str, bool | None]:
    ll, fs = get("ll"), get("fleetshift")
    ratio = fs["cost_per_mtok"] / ll["cost_per_mtok"]
    applies = ll["load"] <= LOAD_ALLOWS
    return f"{ratio:.2f}x (load {ll['load']:.2f})", (ratio <= COST_CUT) if applies else None


def goodput_cell(get: Callable[[str], dict[str, Any]]) -> tuple[str, bool | None]:
    best = max(get("ll")["goodput_rps"], get("split")["goodput_rps"])
    ratio = get("fleetshift-all")["goodput_rps"] / best
    return f"{ratio:.3f}x", ratio >= 1.0


def oracle_cell(get: Callable[[str], dict[str, Any]]) -> tuple[str, bool | None]:
    ratio = get("fleetshift-all")["goodput_rps"] / get("oracle")["goodput_rps"]
    return f"{100 * ratio:.1f} %", ratio >= ORACLE_SHARE


def shift_cell(get: Callable[[str], dict[str, Any]]) -> tuple[str, bool | None]:
    split = get("split")["goodput_after_rps"]
    ratio = get("fleetshift-all")["goodput_after_rps"] / max(split, 1e-9)
    return f"{ratio:.2f}x", ratio >= SPLIT_GAIN


def raw_table(
    names: Sequence[str], rates: Sequence[float], runs: dict[tuple[str, float, str], dict[str, Any]]
) -> list[str]:
    traces = _traces(0, 60.0)  # which column a trace belongs to does not depend on its span
    lines = ["| trace | column | rate | requests | policy | goodput r/s | SLO met | $/M tok | p99 slowdown TTFT / TBT | moves | dropped | sim s |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in names:
        for rate in rates:
            for p in POLICIES:
                r = runs.get((n, rate, p))
                if r is None:
                    continue
                col = "tuning" if traces[n].tuning else "held out"
                lines.append(
                    f"| {n} | {col} | x{rate:g} | {r['requests']} | {p} | {r['goodput_rps']:.2f} | "
                    f"{100 * r['slo_attainment']:.1f} % | {r['cost_per_mtok']:.2f} | "
                    f"{r['ttft_slowdown_p99']:.1f} / {r['tbt_slowdown_p99']:.1f} | {r['moves']} | "
                    f"{r['dropped']} | {r['wall_s']:.1f} |"
                )
    return lines


def capacity_table(
    names: Sequence[str], caps: list[dict[str, Any]]
) -> tuple[list[str], dict[str, int]]:
    traces = _traces(0, 60.0)  # which column a trace belongs to does not depend on its span
    lines = ["| trace | column | cheapest static design | $/h | fleetshift (billed $/h) | ratio | fleetshift-all $/h | ratio | target <= 0.8x |",
             "|---|---|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
    tally = {"met": 0, "missed": 0, "n/a": 0}
    for n in names:
        mine = [c for c in caps if c["trace"] == n]
        statics = [c for c in mine if c["kind"] == "design" and c["usd_per_hour"] is not None]
        if not mine:
            continue
        cheapest = min(statics, key=lambda c: c["usd_per_hour"], default=None)
        dyn = {c["policy"]: c for c in mine if c["kind"] == "dynamic"}
        static = cheapest["usd_per_hour"] if cheapest else None
        fs, fsa = dyn.get("fleetshift"), dyn.get("fleetshift-all")
        r_fs = _ratio(fs, "billed_usd_per_hour", static)
        r_fsa = _ratio(fsa, "usd_per_hour", static)
        ok = None if static is None else (r_fs is not None and r_fs <= DYNAMIC_SHARE)
        if not traces[n].tuning:
            tally[verdict(ok).strip("*")] += 1
        fleet = _fleet(cheapest["counts"]) if cheapest else "none passed"
        lines.append(
            f"| {n} | {'tuning' if traces[n].tuning else 'held out'} | "
            f"{cheapest['label'] if cheapest else '-'} {fleet} | {static or float('nan'):.2f} | "
            f"{_fleet(fs['counts']) + ' ' + format(fs['billed_usd_per_hour'], '.2f') if fs and fs['counts'] else 'none passed'} | "
            f"{r_fs if r_fs is not None else float('nan'):.2f} | "
            f"{fsa['usd_per_hour'] if fsa and fsa['usd_per_hour'] else float('nan'):.2f} | "
            f"{r_fsa if r_fsa is not None else float('nan'):.2f} | {verdict(ok)} |"
        )
    return lines, tally


def _ratio(c: dict[str, Any] | None, key: str, static: float | None) -> float | None:
    return c[key] / static if (c and static and c[key] is not None) else None


def _fleet(counts: Sequence[Sequence[Any]] | None) -> str:
    from fleetshift_daemon.sim.capacity import short

    return "+".join(f"{n}{short(k)}" for k, n in counts) if counts else "-"


# ----- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3-minute traces, x1 and x2: a smoke run")
    ap.add_argument("--traces", default=",".join(TRACE_NAMES))
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument(
        "--minutes", type=float, default=20.0, help="each trace this long (0: whole traces)"
    )
    ap.add_argument("--capacity-minutes", type=float, default=5.0, help="0: no capacity search")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/fleetshift-validation"))
    ap.add_argument("--doc", type=Path, help="markdown doc whose results section to rewrite")
    args = ap.parse_args(argv)
    args.names = [n.strip() for n in args.traces.split(",") if n.strip()]
    args.rate_list = [float(r) for r in args.rates.split(",")]
    if args.quick:
        args.minutes = min(args.minutes, 3.0)
        args.rate_list = [1.0, 2.0]
        args.capacity_minutes = min(args.capacity_minutes, 1.0)
    return args


def commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + (" (with uncommitted changes)" if dirty else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()
    _traces(args.seed, args.minutes * 60.0)  # fail on a bad name before any worker starts
    tasks = [
        {"trace": n, "rate": r, "policy": p, "span_s": args.minutes * 60.0, "seed": args.seed}
        for p in reversed(POLICIES)  # the oracle is the longest: start it first
        for n in args.names
        for r in args.rate_list
    ]
    print(f"{len(tasks)} policy runs on {args.jobs} worker processes", flush=True)
    results = run_all(tasks, args.jobs, run_policy)
    caps: list[dict[str, Any]] = []
    if args.capacity_minutes > 0:
        cap_tasks = [
            {"trace": n, "minutes": args.capacity_minutes, "seed": args.seed, "kind": "design",
             "design": (d.prefill_kind, d.decode_kind)} for n in args.names for d in DESIGNS
        ] + [
            {"trace": n, "minutes": args.capacity_minutes, "seed": args.seed, "kind": "dynamic",
             "policy": p} for n in args.names for p in DYNAMIC
        ]  # fmt: skip
        print(f"{len(cap_tasks)} capacity searches", flush=True)
        caps = run_all(cap_tasks, args.jobs, run_capacity)
    wall = time.perf_counter() - t0
    runs = by_key(results)
    shifts = [n for n in args.names if n in SHIFT_NAMES]
    md: list[str] = []
    tallies: dict[str, dict[str, int]] = {}
    for key, title, names, cell in (
        ("slo", f"`fleetshift` SLO attainment vs `ll` (target: at most {SLO_POINTS:g} point below)", args.names, slo_cell),
        ("cost", f"`fleetshift` $/M tokens vs `ll` (target <= {COST_CUT:g}x where the model puts the load at <= {LOAD_ALLOWS:g} of the fleet; n/a elsewhere)", args.names, cost_cell),
        ("goodput", "`fleetshift-all` goodput vs the better of `ll` and `split` (target >= 1x)", args.names, goodput_cell),
        ("shift", f"`fleetshift-all` goodput vs `split` after the shift, the half against split's deploy-time pools (target >= {SPLIT_GAIN:g}x)", shifts, shift_cell),
        ("oracle", f"`fleetshift-all` goodput as a share of the hindsight bound (target >= {100 * ORACLE_SHARE:g} %)", args.names, oracle_cell),
    ):  # fmt: skip
        if not names:
            continue
        lines, tallies[key] = property_table(title, names, args.rate_list, runs, cell)
        md += lines
    if caps:
        lines, tallies["capacity"] = capacity_table(args.names, caps)
        md += [
            f"#### Capacity at x1: `fleetshift`'s billed cost vs the cheapest static design (target <= {DYNAMIC_SHARE:g}x)",
            "",
            f"Each trace built {args.capacity_minutes:g} min long (as above, shorter), at x1;"
            " DGX-A100 2.21, DGX-H100 4.76 per machine-hour;"
            " P99 TTFT slowdown <= 6, TBT <= 5 against an idle DGX-A100; static designs"
            " Baseline-A100, Baseline-H100, Splitwise-HA, Splitwise-HH; dynamic policies on half"
            " A100, half H100.",
            "",
            *lines,
            "",
            f"Held out: met {tallies['capacity']['met']}, missed {tallies['capacity']['missed']}, not applicable {tallies['capacity']['n/a']}.",
            "",
        ]  # fmt: skip
    traces = _traces(args.seed, args.minutes * 60.0)
    over = {n: traces[n].over_window for n in args.names}
    md += [
        "#### Every run",
        "",
        "Requests longer than the model's window (replayed, counted): "
        + ", ".join(f"{n} {c}" for n, c in over.items())
        + ".",
        "",
        *raw_table(args.names, args.rate_list, runs),
        "",
    ]
    header = [
        f"Command: `.venv/bin/python bench/sim_validation.py {argv_text}`".replace("  ", " "),
        f"({started:%Y-%m-%d %H:%M} UTC, {wall / 60:.1f} min wall on {args.jobs} worker processes, commit {commit()}).",
        "",
    ]
    text = "\n".join(header + md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation.md").write_text(text + "\n")
    (args.out / "validation.json").write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items() if k not in ("out", "doc")},
                "wall_s": wall,
                "tallies": tallies,
                "runs": results,
                "capacity": caps,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    if args.doc:
        write_doc(args.doc, text)
    print(f"wrote {args.out / 'validation.md'}" + (f" and {args.doc}" if args.doc else ""))
    return 0


def write_doc(path: Path, text: str) -> None:
    doc = path.read_text()
    start, end = doc.find(MARK[0]), doc.find(MARK[1])
    if start < 0 or end < start:
        raise SystemExit(f"{path}: needs the markers {MARK[0]} and {MARK[1]}")
    path.write_text(doc[: start + len(MARK[0])] + "\n" + text + "\n" + doc[end:])


if __name__ == "__main__":
    sys.exit(main())
