"""A profile's files: the CSV of the reference table's shape, its JSON sidecar, and the plot.

The CSV has the columns of ``../shared/reference/splitwise_perf_llama2_70b.csv`` that carry
times (one row per repeat, times in ms, like the reference: readers take the median), so the
same loaders and ``fleetshift calibration`` read a measured profile and the reference alike.
A sweep that probed its host adds ``HOST_COLUMNS`` after them, which readers may ignore.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetshift_daemon.cli.profile.knee import CurvePoint, Knee, find_knee
from fleetshift_daemon.cli.profile.measure import Timing
from fleetshift_daemon.core.measurements import HOST_COLUMNS as HOST_COLUMNS
from fleetshift_daemon.core.measurements import SHARE_COLUMN as SHARE_COLUMN

COLUMNS = (
    "model",
    "hardware",
    "tensor_parallel",
    "prompt_size",
    "batch_size",
    "token_size",
    "prompt_time",
    "token_time",
    "e2e_time",
)
# ``HOST_COLUMNS`` (the reader's names), optional, after the reference columns: the host's
# speed around each run (``HostProbe``), written when the sweep probed it (a CPU worker on the
# profiler's host). ``SHARE_COLUMN``, likewise, where the worker's process was found on this
# host: its CPU seconds over the run's wall time (``e2e_time``).
NEED_MATPLOTLIB = (
    "the plot needs matplotlib: pip install 'fleetshift[sim]' (CSV and sidecar written)"
)


@dataclass(frozen=True)
class ProfileLabel:
    model: str
    hardware: str
    tensor_parallel: int


def write_csv(path: Path, label: ProfileLabel, timings: Sequence[Timing]) -> None:
    probed = all(t.host for t in timings)
    shared = all(t.worker_cpu_s is not None for t in timings)
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(
            COLUMNS + (HOST_COLUMNS if probed else ()) + ((SHARE_COLUMN,) if shared else ())
        )
        for t in timings:
            host: tuple[str, ...] = (
                (f"{t.host.matmul_gflops:.3f}", f"{t.host.copy_gbps:.3f}")
                if probed and t.host
                else ()
            )
            if shared and t.worker_cpu_s is not None:
                # The kernel counts a process's CPU time in clock ticks (10 ms here): a run
                # shorter than one can read none. That share is unknown, not zero (a zero
                # would read as a worker that computed nothing, and calibration refuses it).
                share = t.worker_cpu_s / t.e2e_s
                host += (f"{share:.4f}" if share > 0 else "",)
            out.writerow(
                (
                    label.model,
                    label.hardware,
                    label.tensor_parallel,
                    t.point.prompt_size,
                    t.point.batch_size,
                    t.point.token_size,
                    f"{t.prompt_s * 1e3:.4f}",
                    f"{t.token_s * 1e3:.4f}",
                    f"{t.e2e_s * 1e3:.4f}",
                    *host,
                )
            )


@dataclass(frozen=True)
class Summary:
    """Medians over repeats, and the knee of each prompt size's concurrency curve."""

    medians: dict[int, list[CurvePoint]]  # prompt size -> decode curve
    knees: dict[int, Knee]


def summarise(timings: Sequence[Timing]) -> Summary:
    by_point: dict[tuple[int, int], list[float]] = defaultdict(list)
    for t in timings:
        by_point[(t.point.prompt_size, t.point.batch_size)].append(t.token_s)
    curves: dict[int, list[CurvePoint]] = defaultdict(list)
    for (prompt, batch), steps in sorted(by_point.items()):
        step = statistics.median(steps)
        curves[prompt].append(CurvePoint(batch, batch / step, step))
    return Summary(dict(curves), {p: find_knee(c) for p, c in curves.items()})


def write_sidecar(path: Path, content: dict[str, Any], summary: Summary) -> None:
    content = dict(content)
    content["knees"] = [
        {
            "prompt_size": prompt,
            "concurrency": k.concurrency,
            "decode_tokens_per_s": round(k.throughput, 3),
            "token_time_ms": round(k.latency * 1e3, 4),
            "saturated": k.saturated,
            "definition": "concurrency maximising decode throughput / step time",
        }
        for prompt, k in sorted(summary.knees.items())
    ]
    path.write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")


def write_plot(path: Path, title: str, summary: Summary) -> None:
    """Throughput and step latency against concurrency, one line per prompt size, knees
    marked. Raises ImportError when matplotlib (the optional ``sim`` extra) is missing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 7))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for prompt, curve in sorted(summary.medians.items()):
        xs = [p.concurrency for p in curve]
        (line,) = top.plot(xs, [p.throughput for p in curve], marker="o", label=f"prompt {prompt}")
        bottom.plot(xs, [p.latency * 1e3 for p in curve], marker="o", color=line.get_color())
        knee = summary.knees[prompt]
        for ax, y in ((top, knee.throughput), (bottom, knee.latency * 1e3)):
            ax.plot([knee.concurrency], [y], marker="*", markersize=16, color=line.get_color())
    top.set_ylabel("decode throughput (tokens/s)")
    bottom.set_ylabel("decode step (ms)")
    bottom.set_xlabel("concurrency (sessions in the batch)")
    ticks = sorted({p.concurrency for curve in summary.medians.values() for p in curve})
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(True, alpha=0.3)
    top.legend(title="★ knee", fontsize=8)
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
