"""What the daemon says while the demo runs, read through its public API once a second:
the traffic mix, the efficiency figure, the operations the automatic planner ran (each step
with its kind and the sessions it carried) and the workers. Changes become events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as opb
from fleetshift.v1 import operations_pb2_grpc as ogrpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as pgrpc
from fleetshift_common.lifecycle import wait_or_timeout
from fleetshift_daemon.wire import ROLE_FROM_PB

STEP_KIND_TEXT = {
    opb.STEP_KIND_ROLE_CHANGE: "role change",
    opb.STEP_KIND_MIGRATE: "warm move",
    opb.STEP_KIND_COLD_START: "cold move",
    opb.STEP_KIND_START: "start",
    opb.STEP_KIND_RETIRE: "retire",
}


def role_text(role: int) -> str:
    found = ROLE_FROM_PB.get(role)  # type: ignore[call-overload]
    return found.value if found is not None else "?"


@dataclass
class Sample:
    t: float
    efficiency: float | None
    rate_per_s: float
    prompt_mean: float
    output_mean: float
    prefill_decode: float
    workers: int
    in_flight: int = 0  # steps of any operation pending or running at this poll


# Three polls a second apart: at least one fresh planning pass at the demo's 2 s interval, so
# one pass that happens to land on the line is not called a recovery. Not tuned.
HOLD_SAMPLES = 3


def recovered_at(samples: Sequence[Sample], threshold: float) -> float | None:
    """When the figure came back and stayed back to the last sample, or None.

    Back means: the daemon's figure at or above ``threshold`` with no step in flight, for the
    last ``HOLD_SAMPLES`` samples at least, after a sample below the threshold. The time is
    the first sample of that closing run; a figure that came back and fell again has not
    recovered (yet)."""
    run_start: int | None = None
    for i in range(len(samples) - 1, -1, -1):
        s = samples[i]
        if s.efficiency is None:
            continue  # the daemon had no figure yet: neither back nor below
        if s.efficiency >= threshold and s.in_flight == 0:
            run_start = i
            continue
        if run_start is None:
            return None
        counted = [x for x in samples[run_start:] if x.efficiency is not None]
        fell = s.efficiency < threshold or any(
            x.efficiency is not None and x.efficiency < threshold for x in samples[:i]
        )
        return samples[run_start].t if fell and len(counted) >= HOLD_SAMPLES else None
    return None  # never below the threshold (or no figure at all): nothing to recover from


@dataclass
class Step:
    op_id: str
    index: int
    kind: str
    worker: str
    source_node: str
    target_node: str
    target_role: str
    state: str
    started: float | None  # seconds from the replay's start
    finished: float | None
    sessions_carried: int
    max_pause_ms: float
    error: str

    def line(self) -> str:
        where = (
            f"{self.source_node or '?'} -> {self.target_node}"
            if self.kind != "start"
            else self.target_node
        )
        return f"{self.kind} of {self.worker or 'a new worker'} ({where}, as {self.target_role})"


@dataclass
class FleetWatch:
    """The latest figures and everything that changed, in replay seconds."""

    daemon: grpc.aio.Channel
    model: str
    started: float  # time.monotonic() of the replay's start
    wall_started: float  # time.time() at the same instant (operation stamps are wall clock)
    say: Callable[[str], None]
    threshold: float = 0.95
    samples: list[Sample] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    steps: dict[tuple[str, int], Step] = field(default_factory=dict)
    operations: dict[str, opb.Operation] = field(default_factory=dict)
    workers: list[fpb.WorkerStatus] = field(default_factory=list)
    below_for_s: float = 0.0
    alarm_on: bool = False
    recovered: float | None = None  # when the figure came back (``recovered_at``), if it has
    first_recovered: float | None = None  # the first time it did (it may have fallen again)
    _nodes_of: dict[str, str] = field(default_factory=dict)

    def now(self) -> float:
        return time.monotonic() - self.started

    def event(self, text: str) -> None:
        t = self.now()
        self.events.append((t, text))
        self.say(f"[{t:6.1f} s] {text}")

    def steps_done(self) -> list[Step]:
        return [s for s in self.steps.values() if s.state == "done"]

    def moves_running(self) -> set[tuple[str, int]]:
        """The steps not finished yet, as (operation id, step index)."""
        return {k for k, s in self.steps.items() if s.state in ("pending", "running")}

    async def poll(self) -> None:
        planning = pgrpc.PlanningStub(self.daemon)
        report = await planning.GetEfficiency(ppb.GetEfficiencyRequest(history=1), timeout=10)
        mix = await planning.GetTrafficMix(ppb.GetTrafficMixRequest(model=self.model), timeout=10)
        listed = await planning.ListWorkers(ppb.ListWorkersRequest(model=self.model), timeout=10)
        ops = await ogrpc.OperationsStub(self.daemon).ListOperations(
            opb.ListOperationsRequest(limit=50), timeout=10
        )
        self.workers = [w for w in listed.workers if w.state != fpb.WORKER_STATE_STOPPED]
        for w in self.workers:
            self._nodes_of[w.worker_id] = w.node_name
        self.threshold = report.threshold or self.threshold
        for op in sorted(ops.operations, key=lambda o: o.created_at.ToNanoseconds()):
            self._operation(op)
        efficiency = report.latest.efficiency if report.HasField("latest") else None
        m = mix.models[0] if mix.models else None
        self.samples.append(
            Sample(
                self.now(),
                efficiency,
                m.arrival_rate_per_s if m else 0.0,
                m.prompt_tokens.mean if m else 0.0,
                m.output_tokens.mean if m else 0.0,
                m.prefill_decode_ratio if m else 0.0,
                len(self.workers),
                len(self.moves_running()),
            )
        )
        self.below_for_s = report.below_threshold_for_s
        self._alarm(efficiency)
        self._recovery()

    def _alarm(self, efficiency: float | None) -> None:
        """An alarm once the figure has been under the threshold for two samples in a row,
        cleared once it has been back at or over it for three: one sample at the line is
        noise, and a log that flips with it would hide the story."""
        if efficiency is None:
            return
        recent = [s.efficiency for s in self.samples[-3:] if s.efficiency is not None]
        if not self.alarm_on and len(recent) >= 2 and max(recent[-2:]) < self.threshold:
            self.alarm_on = True
            self.event(
                f"ALARM: placement efficiency {efficiency:.3f} < threshold {self.threshold:.2f}"
                " (the planner acts once the gap has held)"
            )
        elif self.alarm_on and len(recent) == 3 and min(recent) >= self.threshold:
            self.alarm_on = False
            self.event(f"efficiency back to {efficiency:.3f} (>= {self.threshold:.2f})")

    def _recovery(self) -> None:
        back = recovered_at(self.samples, self.threshold)
        if back is not None and self.recovered is None:
            if self.first_recovered is None:
                self.first_recovered = back
            figure = self.samples[-1].efficiency or 0.0
            self.event(
                f"RECOVERED: placement efficiency {figure:.3f} >= threshold "
                f"{self.threshold:.2f} with no move in flight (back since {back:.1f} s)"
            )
        self.recovered = back

    def _stamp(self, ts: object) -> float | None:
        nanos = ts.ToNanoseconds()  # type: ignore[attr-defined]
        return None if not nanos else nanos / 1e9 - self.wall_started

    def _operation(self, op: opb.Operation) -> None:
        if op.id not in self.operations:
            kinds = ", ".join(STEP_KIND_TEXT.get(s.kind, "?") for s in op.steps)
            who = op.requested_by or "?"
            self.event(f"PLAN {op.id} by {who}: {len(op.steps)} step(s): {kinds}")
        self.operations[op.id] = op
        for s in op.steps:
            key = (op.id, s.index)
            state = opb.StepState.Name(s.state).removeprefix("STEP_STATE_").lower()
            step = Step(
                op.id,
                s.index,
                STEP_KIND_TEXT.get(s.kind, "?"),
                s.worker_id,
                self._nodes_of.get(s.worker_id, ""),
                s.target_node,
                role_text(s.target_role),
                state,
                self._stamp(s.started_at),
                self._stamp(s.finished_at),
                s.sessions_carried,
                s.max_session_pause_ms,
                s.error,
            )
            old = self.steps.get(key)
            if old is not None and old.source_node:
                step.source_node = old.source_node
            self.steps[key] = step
            if old is None or old.state != state:
                self._step_event(step)

    def _step_event(self, step: Step) -> None:
        if step.state == "running":
            self.event(f"MOVE {step.line()}: running")
        elif step.state == "done":
            took = (
                f" in {step.finished - step.started:.1f} s"
                if step.started is not None and step.finished is not None
                else ""
            )
            carried = f", carried {step.sessions_carried} session(s)"
            pause = f", longest pause {step.max_pause_ms:.0f} ms" if step.sessions_carried else ""
            self.event(f"MOVE {step.line()}: done{took}{carried}{pause}")
        elif step.state in ("failed", "rolled_back", "skipped"):
            self.event(f"MOVE {step.line()}: {step.state} {step.error}")


async def watch(fleet: FleetWatch, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """Poll until ``stop`` is set; a daemon that does not answer once is tried again."""
    while not stop.is_set():
        try:
            await fleet.poll()
        except grpc.aio.AioRpcError as err:
            fleet.say(f"(daemon did not answer: {err.code().name})")
        await wait_or_timeout(stop, every_s)
