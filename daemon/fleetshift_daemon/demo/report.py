"""The demo's closing summary (text a newcomer reads) and its PNG timeline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fleetshift_daemon.demo.replay import StreamRecord
from fleetshift_daemon.demo.settle import Outcome
from fleetshift_daemon.demo.verify import Verdict
from fleetshift_daemon.demo.watch import FleetWatch, Step
from fleetshift_daemon.demo.workload import (
    CARRIER,
    DECODE_HEAVY,
    PROMPT_HEAVY,
    SETTLING,
    Workload,
)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def latency_lines(records: Sequence[StreamRecord]) -> list[str]:
    out = []
    for phase in (PROMPT_HEAVY, DECODE_HEAVY, SETTLING, CARRIER):
        rs = [r for r in records if r.request.phase == phase and r.first_at is not None]
        ttft = [r.ttft_s or 0.0 for r in rs]
        gaps = [g for r in rs for g in r.gaps_s()]
        if not rs:
            continue
        out.append(
            f"  {phase:13s} {len(rs):4d} requests  TTFT p50 {_pct(ttft, 50):6.2f} s "
            f"p99 {_pct(ttft, 99):6.2f} s   TBT p50 {_pct(gaps, 50) * 1e3:5.0f} ms "
            f"p99 {_pct(gaps, 99) * 1e3:6.0f} ms  max {max(gaps, default=0) * 1e3:6.0f} ms"
        )
    return out


def _why_none_carried(moves: Sequence[Step], records: Sequence[StreamRecord]) -> list[str]:
    """When moves ran and none carried a session, the figures that say why: a moving worker
    serves until its target has started, then takes no new session and carries what is open
    on it at that moment, so a run of short streams can leave it none to carry."""
    relocations = [
        s for s in moves if s.kind in ("warm move", "cold move") and s.finished and s.started
    ]
    if not relocations or any(s.sessions_carried for s in moves) or not records:
        return []
    longest = max(r.ended_at - r.sent_at for r in records)
    return [
        f"  (no stream was open on a moved worker when its target had started and its "
        f"sessions were copied; the longest stream lasted {longest:.1f} s)"
    ]


def _by_planner(watch: FleetWatch, step: Step) -> bool:
    op = watch.operations.get(step.op_id)
    return op is None or op.requested_by.startswith("planner")


def summary_lines(
    workload: Workload,
    records: Sequence[StreamRecord],
    watch: FleetWatch,
    verdict: Verdict,
    check_all: bool,
    carriers: Sequence[StreamRecord] = (),
    settling: Sequence[StreamRecord] = (),
    outcome: Outcome | None = None,
    settle_rate: float = 0.0,
) -> list[str]:
    """``records`` are the replay's streams; ``carriers`` the long ones the demo kept open
    while moves ran (``demo.carriers``), ``settling`` the decode-heavy shapes sent after the
    replay while it waited for the figure (``demo.settle``), each on their own line;
    ``outcome`` whether the figure came back, and when or why not."""
    served = sum(1 for r in records if not r.error and r.finish_reason)
    failed = len(verdict.failed)
    tokens = sum(len(r.texts) for r in records)
    moves = [s for s in watch.steps.values() if s.state == "done"]
    carried = sum(s.sessions_carried for s in moves)
    kinds: dict[str, int] = {}
    for s in moves:
        kind = s.kind if _by_planner(watch, s) else f"{s.kind} (the demo's operator move)"
        kinds[kind] = kinds.get(kind, 0) + 1
    effs = [s.efficiency for s in watch.samples if s.efficiency is not None]
    lines = [
        f"requests served: {served} of {len(workload.requests)} "
        f"({tokens:,} tokens streamed through the gateway)"
        + (f"; {failed} failed with an error the client saw" if failed else ""),
        "steps run: "
        + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none")
        + f"; sessions moved: {carried}",
    ]
    if carriers:
        kept = sum(1 for r in carriers if not r.error and r.finish_reason)
        lines.append(
            f"  long streams kept open while moves ran (so a moving worker has live sessions to "
            f"carry): {len(carriers)} ({kept} served, {sum(len(r.texts) for r in carriers):,} "
            "tokens)"
        )
    if settling:
        kept = sum(1 for r in settling if not r.error and r.finish_reason)
        lines.append(
            f"  after the replay, while waiting for the figure: {len(settling)} requests of the "
            f"decode-heavy half's shapes at {settle_rate:g}/s ({kept} served)"
        )
    lines.extend(_why_none_carried(moves, [*records, *carriers]))
    for s in sorted(moves, key=lambda s: s.started or 0.0):
        who = "" if _by_planner(watch, s) else " (operator move)"
        lines.append(f"  {s.started or 0:6.1f} s  {s.line()}{who}: carried {s.sessions_carried}")
    for s in watch.steps.values():
        if s.state in ("pending", "running"):
            lines.append(f"  {s.started or 0:6.1f} s  {s.line()}: still {s.state} at the end")
        elif s.state not in ("done",):
            lines.append(f"  {s.started or 0:6.1f} s  {s.line()}: {s.state} {s.error}")
    lost, repeated = verdict.tokens_lost, verdict.tokens_repeated
    scope = "every stream" if check_all else "the streams open when a move switched"
    lines.append(
        f"tokens lost or repeated in served streams: {lost + repeated}"
        + (" (checked)" if verdict.clean else " -- CHECK FAILED")
    )
    lines.append(
        f"  {verdict.complete} of {verdict.streams - failed} served streams got exactly max_tokens "
        "chunks, one per token, matching their usage"
    )
    lines.append(
        f"  {verdict.equal} of {verdict.compared} ({scope}) equal an unmoved rerun of the same "
        "seeded request, token for token"
    )
    for problem in (verdict.incomplete + verdict.differing + verdict.unchecked)[:10]:
        lines.append(f"  ! {problem}")
    for failure in verdict.failed[:5]:
        lines.append(f"  failed: {failure}")
    if len(verdict.failed) > 5:
        lines.append(f"  failed: ... and {len(verdict.failed) - 5} more (the demo's output above)")
    if effs:
        lines.append(
            f"efficiency: lowest {min(effs):.2f}, at the end {effs[-1]:.2f} "
            f"(threshold {watch.threshold:.2f})"
        )
    if outcome is not None:
        lines.append(f"  {outcome.line(watch.threshold)}")
    lines.append("latency through the gateway (this CPU, not a GPU):")
    lines.extend(latency_lines([*records, *settling, *carriers]))
    return lines


def plot_timeline(
    path: Path,
    workload: Workload,
    records: Sequence[StreamRecord],
    watch: FleetWatch,
    outcome: Outcome | None = None,
) -> str:
    """Write the PNG; returns a line saying where, or why not (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is missing (pip install 'fleetshift[sim]')"
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    t = [s.t for s in watch.samples]
    ax = axes[0]
    ax.plot(t, [s.prefill_decode for s in watch.samples], label="prefill:decode tokens")
    ax.set_ylabel("prefill:decode")
    ax2 = ax.twinx()
    ax2.plot(t, [s.output_mean for s in watch.samples], color="tab:orange", label="mean output")
    ax2.set_ylabel("mean output tokens")
    ax.legend(
        ax.get_lines() + ax2.get_lines(),
        ["prefill:decode tokens", "mean output tokens"],
        loc="center left",
    )
    ax.set_title("Traffic mix in the daemon's window")
    ax = axes[1]
    eff = [np.nan if s.efficiency is None else s.efficiency for s in watch.samples]
    ax.plot(t, eff, color="tab:green", label="placement efficiency")
    ax.axhline(watch.threshold, color="tab:red", linestyle="--", label="threshold")
    ax.set_ylabel("efficiency")
    ax.set_ylim(0, 1.05)
    _mark_recovery(ax, outcome, watch)
    ax.legend(loc="lower left")
    ax = axes[2]
    done = [r for r in records if r.first_at is not None]
    ax.scatter([r.sent_at for r in done], [r.ttft_s for r in done], s=8, label="TTFT (s)")
    gaps = [(r.chunk_at[i + 1], g) for r in done for i, g in enumerate(r.gaps_s())]
    if gaps:
        xs, ys = zip(*gaps, strict=True)
        ax.scatter(xs, ys, s=1, alpha=0.3, color="tab:gray", label="token gap (s)")
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_xlabel("seconds from the start of the replay")
    ax.legend(loc="upper left")
    _mark_moves(axes, watch.steps.values(), workload.turn_at_s)
    if t and t[-1] > workload.duration_s:  # the settling traffic after the replay
        for ax in axes:
            ax.axvline(workload.duration_s, color="black", linestyle=":", linewidth=1)
        axes[0].text(
            workload.duration_s,
            0.8,
            " replay ends; its second half's\n shapes at a steady rate",
            transform=axes[0].get_xaxis_transform(),
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"timeline: {path}"


def _mark_recovery(ax: Any, outcome: Outcome | None, watch: FleetWatch) -> None:
    """The recovery on the efficiency panel: a line where the figure came back, or a note
    where the demo stopped waiting without it."""
    if outcome is None or not watch.samples:
        return
    if outcome.recovered is not None:
        ax.axvline(outcome.recovered, color="tab:green", linestyle="-.", label="recovered")
        ax.text(outcome.recovered, 1.0, " RECOVERED", color="tab:green", fontsize=8, va="top")
        return
    end = watch.samples[-1].t
    ax.text(end, 1.0, "not recovered ", color="tab:red", fontsize=8, va="top", ha="right")


def _mark_moves(axes: object, steps: object, turn_at: float) -> None:
    colours = {"warm move": "tab:blue", "cold move": "tab:purple", "role change": "tab:olive"}
    for ax in axes:  # type: ignore[attr-defined]
        ax.axvline(turn_at, color="black", linestyle=":", linewidth=1)
        for s in steps:  # type: ignore[attr-defined]
            if s.started is None:
                continue
            end = s.finished if s.finished is not None else s.started + 1
            ax.axvspan(s.started, end, alpha=0.15, color=colours.get(s.kind, "tab:cyan"))
    top = axes[0]  # type: ignore[index]
    top.text(
        turn_at, 0.9, " mix turns decode-heavy", transform=top.get_xaxis_transform(), fontsize=8
    )
    for s in steps:  # type: ignore[attr-defined]
        if s.started is not None:
            axes[1].text(s.started, 0.05, f" {s.kind}", rotation=90, fontsize=7)  # type: ignore[index]
