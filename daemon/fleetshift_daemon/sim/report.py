"""How a comparison is shown: a table on the terminal, CSV/JSON for tools, PNG for people."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from fleetshift_common.errors import FailedPrecondition
from fleetshift_daemon.sim.metrics import goodput_series, outcomes
from fleetshift_daemon.sim.runner import RunResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

CDF_POINTS = 201
PLOT_SIZE_IN = (9.0, 4.5)
PLOT_DPI = 110
NEED_MATPLOTLIB = "plots need matplotlib: pip install 'fleetshift[sim]', or pass --no-plots"


def table(results: Sequence[RunResult], title: str = "") -> Table:
    t = Table(title=title or None)
    for col in (
        "policy", "goodput r/s", "SLO %", "TTFT p50/p99 s", "TBT p50/p99 ms", "E2E p99 s",
        "p99 slowdown TTFT/TBT", "$/M tok", "$/M good tok", "moves", "dropped", "sim s",
    ):  # fmt: skip
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in results:
        s = r.summary
        t.add_row(
            s.policy,
            f"{s.goodput_rps:.2f}",
            f"{100 * s.slo_attainment:.1f}",
            f"{s.ttft_s[50]:.2f}/{s.ttft_s[99]:.2f}",
            f"{1e3 * s.tbt_s[50]:.0f}/{1e3 * s.tbt_s[99]:.0f}",
            f"{s.e2e_s[99]:.1f}",
            f"{s.ttft_slowdown_p99:.1f}/{s.tbt_slowdown_p99:.1f}",
            f"{s.cost_per_mtok:.3f}",
            f"{s.cost_per_good_mtok:.3f}",
            str(s.move_count),
            str(s.dropped),
            f"{s.sim_wall_s:.1f}",
        )
    return t


def print_table(
    results: Sequence[RunResult], title: str = "", console: Console | None = None
) -> None:
    (console or Console()).print(table(results, title))


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def write_outputs(
    out: Path, results: Sequence[RunResult], meta: dict[str, Any], plots: bool = True
) -> list[Path]:
    """summary.json/csv, timeseries.csv, moves.csv, cdf.csv and (optionally) PNG plots."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    summaries = [r.summary.as_dict() for r in results]
    path = out / "summary.json"
    path.write_text(json.dumps(_clean({"meta": meta, "policies": summaries}), indent=2) + "\n")
    written.append(path)
    written.append(_summary_csv(out / "summary.csv", results))
    written.append(_timeseries_csv(out / "timeseries.csv", results))
    written.append(_moves_csv(out / "moves.csv", results))
    written.append(_cdf_csv(out / "cdf.csv", results))
    if plots:
        written.extend(draw_plots(out, results))
    return written


def _summary_csv(path: Path, results: Sequence[RunResult]) -> Path:
    cols = [
        "policy", "requests", "finished", "dropped", "slo_met", "goodput_rps", "slo_attainment",
        "throughput_tok_s", "ttft_slowdown_p99", "tbt_slowdown_p99", "cost_per_mtok",
        "cost_per_good_mtok", "move_count", "makespan_s", "sim_wall_s", "events",
    ]  # fmt: skip
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        lat = [f"{m}_p{p}" for m in ("ttft_s", "tbt_s", "e2e_s") for p in (50, 90, 99)]
        kinds = sorted({k for r in results for k in r.summary.utilisation})
        w.writerow(cols + lat + [f"util_{k}" for k in kinds])
        for r in results:
            s = r.summary
            row = [getattr(s, c) for c in cols]
            row += [getattr(s, m)[p] for m in ("ttft_s", "tbt_s", "e2e_s") for p in (50, 90, 99)]
            row += [s.utilisation.get(k, "") for k in kinds]
            w.writerow(row)
    return path


def _timeseries_csv(path: Path, results: Sequence[RunResult]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "time_s", "goodput_rps", "efficiency"])
        for r in results:
            t, g = goodput_series(r.sim, r.sim.config.bucket_s)
            eff = dict(r.sim.efficiency)
            for a, b in zip(t, g, strict=True):
                w.writerow([r.name, f"{a:.0f}", f"{b:.4f}", ""])
            for a, e in sorted(eff.items()):
                w.writerow([r.name, f"{a:.0f}", "", f"{e:.4f}"])
    return path


def _moves_csv(path: Path, results: Sequence[RunResult]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "time_s", "instance", "gpu", "before", "after", "kind", "cost_s"])
        for r in results:
            for m in r.sim.moves:
                w.writerow(
                    [
                        r.name,
                        f"{m.time_s:.1f}",
                        m.instance,
                        m.gpu,
                        m.before,
                        m.after,
                        m.kind,
                        f"{m.cost_s:.2f}",
                    ]
                )
    return path


def _quantiles(values: np.ndarray) -> np.ndarray:
    v = values[np.isfinite(values)]
    if not len(v):
        return np.full(CDF_POINTS, np.nan)
    return np.asarray(np.quantile(v, np.linspace(0, 1, CDF_POINTS)), dtype=np.float64)


def _cdf_csv(path: Path, results: Sequence[RunResult]) -> Path:
    qs = np.linspace(0, 1, CDF_POINTS)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", "metric", "quantile", "seconds"])
        for r in results:
            for metric, values in _latencies(r).items():
                for q, v in zip(qs, _quantiles(values), strict=True):
                    w.writerow([r.name, metric, f"{q:.3f}", f"{v:.6f}"])
    return path


def _latencies(r: RunResult) -> dict[str, np.ndarray]:
    o = outcomes(r.sim)
    fin = o.finished
    multi = fin & (r.sim.output > 1)
    return {"ttft": o.ttft_s[fin], "tbt": o.tbt_s[multi], "e2e": o.e2e_s[fin]}


def require_matplotlib() -> None:
    """Raise FailedPrecondition now, before a long run, if the plots could not be drawn."""
    _figure_factory()


def _figure_factory() -> Callable[[], Figure]:
    # Imported here, not at the top: matplotlib is the optional ``sim`` extra, and only the
    # plots need it. Figure + FigureCanvasAgg draw off-screen without pyplot, so no backend is
    # selected globally and no figure is left registered (open) anywhere.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise FailedPrecondition(NEED_MATPLOTLIB) from exc

    def new() -> Figure:
        fig = Figure(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI, layout="constrained")
        FigureCanvasAgg(fig)
        return fig

    return new


def _axes(fig: Figure, title: str, xlabel: str, ylabel: str) -> Axes:
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    return ax


def _mark_moves(ax: Axes, minutes: Sequence[float]) -> None:
    if minutes:
        ax.vlines(
            minutes, 0, 1, transform=ax.get_xaxis_transform(), colors="0.35", linestyles=":",
            linewidths=0.8, label="fleetshift moves",
        )  # fmt: skip


def _finish(fig: Figure, ax: Axes, path: Path) -> Path:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.savefig(path, dpi=PLOT_DPI)
    fig.clear()
    return path


def draw_plots(out: Path, results: Sequence[RunResult], prefix: str = "sim-") -> list[Path]:
    """Goodput and planner efficiency over time, and the TTFT and TBT CDFs, one PNG each.

    Raises FailedPrecondition if matplotlib (the ``sim`` extra) is not installed.
    """
    figure = _figure_factory()
    color = {r.name: f"C{i % 10}" for i, r in enumerate(results)}  # same colour on every chart
    markers: list[float] = []
    for r in results:
        if r.name == "fleetshift":
            markers = sorted({m.time_s / 60.0 for m in r.sim.moves})
    paths = []

    fig = figure()
    ax = _axes(fig, "Goodput over time (SLO-met requests/s)", "time (minutes)", "goodput (req/s)")
    for r in results:
        t, g = goodput_series(r.sim, r.sim.config.bucket_s)
        shown = t <= r.sim.trace.duration_s * 1.1  # the drain of a collapsed policy is in CSV
        ax.plot(t[shown] / 60.0, g[shown], color=color[r.name], linewidth=1.2, label=r.name)
    ax.set_ylim(bottom=0)
    _mark_moves(ax, markers)
    paths.append(_finish(fig, ax, out / f"{prefix}goodput.png"))

    eff = [r for r in results if r.sim.efficiency]
    if eff:
        fig = figure()
        ax = _axes(
            fig,
            "Planner efficiency (predicted goodput now / best)",
            "time (minutes)",
            "efficiency (fraction of best)",
        )
        for r in eff:
            ax.plot(
                [a / 60.0 for a, _ in r.sim.efficiency],
                [e for _, e in r.sim.efficiency],
                color=color[r.name],
                linewidth=1.2,
                label=r.name,
            )
        ax.set_ylim(bottom=0)
        _mark_moves(ax, markers)
        paths.append(_finish(fig, ax, out / f"{prefix}efficiency.png"))

    qs = np.linspace(0, 1, CDF_POINTS)
    for metric, unit, scale in (("ttft", "s", 1.0), ("tbt", "ms", 1e3)):
        fig = figure()
        ax = _axes(
            fig, f"{metric.upper()} CDF per policy", f"{metric.upper()} ({unit}, log scale)",
            "fraction of requests",
        )  # fmt: skip
        drawn = False
        for r in results:
            values = _quantiles(_latencies(r)[metric]) * scale
            keep = np.isfinite(values) & (values > 0)
            ax.plot(values[keep], qs[keep], color=color[r.name], linewidth=1.2, label=r.name)
            drawn = drawn or bool(keep.any())
        # log scale: a collapsed policy (minutes of queueing) and a healthy one (tens of
        # milliseconds) stay readable on one chart
        if drawn:
            ax.set_xscale("log")
            ax.grid(True, which="minor", axis="x", alpha=0.12)
        ax.set_ylim(0, 1)
        paths.append(_finish(fig, ax, out / f"{prefix}cdf-{metric}.png"))
    return paths
