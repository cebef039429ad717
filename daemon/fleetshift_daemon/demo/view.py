"""The live terminal view: traffic mix, efficiency, moves and workers, redrawn each second.

On a terminal it is a rich ``Live`` display with the event log scrolling above it; piped (a
log, a test) it prints the events and a one-line status every ``status_every_s`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fleetshift_daemon.demo.replay import StreamRecord
from fleetshift_daemon.demo.watch import FleetWatch, role_text
from fleetshift_daemon.demo.workload import DECODE_HEAVY, PROMPT_HEAVY, SETTLING, Workload

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 40) -> str:
    vals = [v for v in values if v == v][-width:]
    return "".join(SPARKS[min(len(SPARKS) - 1, max(0, int(v * (len(SPARKS) - 1))))] for v in vals)


def ratio_text(ratio: float) -> str:
    """prefill:decode tokens; before any decode token the daemon reports a huge ratio."""
    return "-" if ratio > 1e6 else f"{ratio:.1f}"


def phase_at(workload: Workload, t: float) -> str:
    if t >= workload.duration_s:
        return SETTLING  # after the replay: its second half's shapes at a steady rate
    return PROMPT_HEAVY if t < workload.turn_at_s else DECODE_HEAVY


def status_line(watch: FleetWatch, records: Sequence[StreamRecord], workload: Workload) -> str:
    t = watch.now()
    s = watch.samples[-1] if watch.samples else None
    eff = f"{s.efficiency:.2f}" if s and s.efficiency is not None else "-"
    if watch.recovered is not None:
        eff += f" (recovered at {watch.recovered:.0f} s)"
    flying = sum(1 for r in records if not r.done)
    mix = (
        f"{s.rate_per_s:.2f} req/s, prompt {s.prompt_mean:.0f}, output {s.output_mean:.0f}, "
        f"prefill:decode {ratio_text(s.prefill_decode)}"
        if s
        else "-"
    )
    return (
        f"[{t:6.1f} s] {phase_at(workload, t)}: sent {len(records)}/{len(workload.requests)}, "
        f"{flying} streaming; mix {mix}; efficiency {eff}; workers "
        + (", ".join(f"{role_text(w.role)}@{w.node_name}" for w in watch.workers) or "-")
    )


def render(watch: FleetWatch, records: Sequence[StreamRecord], workload: Workload) -> Group:
    t = watch.now()
    s = watch.samples[-1] if watch.samples else None
    head = Text.assemble(
        ("FleetShift demo ", "bold"),
        f"t = {t:5.1f} s of {workload.duration_s:.0f} s   traffic: ",
        (phase_at(workload, t), "bold cyan" if t < workload.turn_at_s else "bold magenta"),
        f" (turns decode-heavy at {workload.turn_at_s:.0f} s)",
    )
    done = sum(1 for r in records if r.done)
    mix = Table.grid(padding=(0, 2))
    mix.add_row(
        "requests",
        f"sent {len(records)} / {len(workload.requests)}, done {done}, "
        f"streaming {len(records) - done}",
    )
    if s is not None:
        mix.add_row(
            "traffic mix",
            f"{s.rate_per_s:.2f} req/s, prompt mean {s.prompt_mean:.0f}, "
            f"output mean {s.output_mean:.0f}, prefill:decode {ratio_text(s.prefill_decode)}",
        )
        effs = [x.efficiency for x in watch.samples if x.efficiency is not None]
        if s.efficiency is not None:
            colour = "green" if s.efficiency >= watch.threshold else "bold red"
            alarm = (
                f"  ALARM for {watch.below_for_s:.0f} s" if s.efficiency < watch.threshold else ""
            )
            back = "" if watch.recovered is None else f"  RECOVERED at {watch.recovered:.0f} s"
            mix.add_row(
                "efficiency",
                Text.assemble(
                    (f"{s.efficiency:.2f}", colour),
                    f" (threshold {watch.threshold:.2f}) ",
                    sparkline(effs),
                    (alarm, "bold red"),
                    (back, "bold green"),
                ),
            )
    moves = Table(
        "t", "step", "state", "sessions", box=None, title="Moves (operations the planner ran)"
    )
    for step in sorted(watch.steps.values(), key=lambda x: (x.started or 1e9, x.index))[-8:]:
        moves.add_row(
            "-" if step.started is None else f"{step.started:.0f}s",
            step.line(),
            step.state,
            str(step.sessions_carried) if step.state == "done" else "",
        )
    workers = Table("worker", "node", "role", "state", "sessions", box=None, title="Workers")
    for w in watch.workers:
        state = "serving" if w.state == 2 else str(w.state)
        workers.add_row(w.worker_id, w.node_name, role_text(w.role), state, str(len(w.session_ids)))
    log = "\n".join(f"{at:6.1f} s  {text}" for at, text in watch.events[-6:])
    return Group(
        Panel(Group(head, mix)), moves, workers, Panel(log or "(no events yet)", title="events")
    )
