"""``fleetshift simulate``: replay a trace on a fleet under each policy and compare them.

Example::

    fleetshift simulate --trace ../shared/traces/azure_llm_2023_conv.csv --policy all \\
        --rate-scale 4 --out /tmp/sim

Without ``--fleet`` the benchmark fleet is used (4 DGX-A100 80GB, 4 DGX-H100, 4 DGX-H200,
Llama-2-70B at TP 8; ``--model llama31-70b`` for long contexts). ``--trace`` takes an Azure
CSV or Mooncake JSON lines. ``--shift`` replaces the trace's request shapes phase by phase
(see ``trace.shifting_mix``); ``prefill-then-decode`` is a prefill-heavy first half and a
decode-heavy second half. ``--then-trace`` splices a second real service in at half time
(``synthetic.service_shift``); ``--arrivals`` keeps the requests and redraws their arrival
times (``synthetic.with_arrivals``: poisson, on-off, ramp).

Requests longer than the model's context window: by default they are counted and replayed
anyway (as the earlier benchmarks and Splitwise's simulator did); ``--context-window model``
(or a token count) refuses them, as a server would, and the title says how many.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from fleetshift_common.errors import FleetShiftError, InvalidArgument
from fleetshift_common.helpformat import DefaultsHelpFormatter, plain_description
from fleetshift_daemon.core.perfmodel import PRESETS
from fleetshift_daemon.sim.engine import SimConfig
from fleetshift_daemon.sim.fleet import SimFleet, load_fleet, standard_fleet
from fleetshift_daemon.sim.report import print_table, require_matplotlib, write_outputs
from fleetshift_daemon.sim.runner import RunOptions, policy_names, run_policies
from fleetshift_daemon.sim.synthetic import ARRIVAL_PROCESSES, service_shift, with_arrivals
from fleetshift_daemon.sim.trace import (
    Phase,
    Shape,
    Trace,
    WindowFit,
    fit_context,
    load_trace,
    shifting_mix,
)

SHIFTS = {
    "prefill-then-decode": (
        Phase(0.5, Shape.PREFILL_HEAVY, prompt_scale=1.5),
        Phase(0.5, Shape.DECODE_HEAVY, output_scale=2.0),
    ),
    "decode-then-prefill": (
        Phase(0.5, Shape.DECODE_HEAVY, output_scale=2.0),
        Phase(0.5, Shape.PREFILL_HEAVY, prompt_scale=1.5),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetshift simulate",
        description=plain_description(__doc__.split("\n")[0]),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--fleet", type=Path, help="fleet TOML (default: the 12-node benchmark fleet)")
    p.add_argument(
        "--trace",
        type=Path,
        required=True,
        help="Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake JSON lines",
    )
    p.add_argument("--model", choices=sorted(PRESETS), help="model of the default fleet")
    p.add_argument(
        "--then-trace", type=Path, help="second service: its requests replace the trace's at half"
    )
    p.add_argument("--switch-at", type=float, help="--then-trace switch time, s (default: half)")
    p.add_argument(
        "--arrivals", choices=ARRIVAL_PROCESSES, help="redraw arrival times, keep the requests"
    )
    p.add_argument(
        "--context-window",
        default="replay",
        help="replay (count over-window requests, keep them), model (refuse them), or tokens",
    )
    p.add_argument(
        "--policy",
        default="all",
        help="all, or a comma list of rr,ll,split,fleetshift,fleetshift-all,oracle",
    )
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    p.add_argument(
        "--time-compress", type=float, default=1.0, help="play the trace this much faster"
    )
    p.add_argument("--shift", choices=sorted(SHIFTS), help="synthesize a shifting mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tick", type=float, default=60.0, help="FleetShift replanning period, s")
    p.add_argument("--oracle-window", type=float, default=300.0, help="hindsight window, s")
    p.add_argument("--max-batch", type=int, default=SimConfig().max_batch)
    p.add_argument("--out", type=Path, help="directory for summary.json/csv, series and plots")
    p.add_argument("--no-plots", action="store_true")
    return p


def prepare_trace(args: argparse.Namespace) -> Trace:
    trace = load_trace(args.trace)
    if args.then_trace:
        trace = service_shift(trace, load_trace(args.then_trace), args.switch_at)
    if args.arrivals:
        trace = with_arrivals(trace, args.arrivals, seed=args.seed)
    if args.shift:
        trace = shifting_mix(trace, SHIFTS[args.shift], seed=args.seed)
    trace = trace.rate_scaled(args.rate_scale, seed=args.seed)
    return trace.time_compressed(args.time_compress)


def choose_fleet(args: argparse.Namespace) -> SimFleet:
    if args.fleet and args.model:
        raise InvalidArgument(
            "--model names the default fleet's model: use one of --fleet, --model", field="model"
        )
    if args.fleet:
        return load_fleet(args.fleet)
    return standard_fleet(preset=args.model or "llama2-70b")


def apply_window(trace: Trace, fleet: SimFleet, spec: str) -> WindowFit:
    """Refuse over-window requests (``model`` or a token count) or only count them (``replay``)."""
    if spec not in ("replay", "model") and not spec.isdigit():
        raise InvalidArgument(
            f"--context-window takes replay, model or a token count, got {spec!r}",
            field="context_window",
        )
    window = int(spec) if spec.isdigit() else fleet.context_window
    if window is None:
        return WindowFit(trace, 0, 0)
    fit = fit_context(trace, window)
    return fit if spec != "replay" else WindowFit(trace, fit.refused, window)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)  # a log or pipe: keep the table readable
    try:
        if args.out and not args.no_plots:
            require_matplotlib()  # fail before the runs, not after them
        fleet = choose_fleet(args)
        fit = apply_window(prepare_trace(args), fleet, args.context_window)
        trace = fit.trace
        names = policy_names(args.policy)
        opts = RunOptions(
            seed=args.seed,
            tick_s=args.tick,
            oracle_window_s=args.oracle_window,
            config=SimConfig(max_batch=args.max_batch),
        )
        results = run_policies(
            fleet,
            trace,
            names,
            opts,
            on_done=lambda r: console.print(f"[dim]{r.name}: {r.summary.sim_wall_s:.1f} s[/dim]"),
        )
    except (FleetShiftError, OSError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    title = (
        f"{len(trace)} requests over {trace.duration_s:.0f} s on {fleet.gpu_count()} GPUs "
        f"(rate x{args.rate_scale:g}, time /{args.time_compress:g}, seed {args.seed})"
    )
    if fit.refused:
        kept = "replayed anyway" if args.context_window == "replay" else "refused"
        title += f"; {fit.refused} over the {fit.window_tokens}-token window {kept}"
    print_table(results, title, console)
    if args.out:
        meta = {
            "trace": str(args.trace),
            "fleet": str(args.fleet) if args.fleet else "standard",
            "rate_scale": args.rate_scale,
            "time_compress": args.time_compress,
            "shift": args.shift,
            "seed": args.seed,
            "requests": len(trace),
            "duration_s": trace.duration_s,
            "model": fleet.arch.name,
            "then_trace": str(args.then_trace) if args.then_trace else None,
            "arrivals": args.arrivals,
            "context_window": fit.window_tokens or None,
            "over_window": fit.refused,
            "over_window_refused": args.context_window != "replay",
        }
        try:
            written = write_outputs(args.out, results, meta, plots=not args.no_plots)
        except (FleetShiftError, OSError) as exc:
            console.print(f"[red]error:[/red] {escape(str(exc))}")
            return 2
        for path in written:
            console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
