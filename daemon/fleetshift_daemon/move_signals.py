"""The snapshot-phase and session-pause histograms, fed from the operation log as moves run.

Every phase of a move is written to the operation log before the next action starts, so the
log already says when each phase was reached and what it measured: the time between two
phases is how long the one in between took as the daemon saw it (its agent call plus the
write of the phase), and ``sessions_copied`` carries the longest session pause the executor
measured. Listening to the log keeps these figures out of the executor's control flow and
makes them impossible to forget on a new path: whatever runs a move, the log records it.

Only what this process saw is reported: a phase whose start was reached before a daemon
restart has no duration here (it would be a guess), and a step is counted once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fleetshift_daemon.core.operations import Operation, Step, StepKind
from fleetshift_rpc.metrics import DaemonMetrics

# phase -> (the phase it is timed from, the label it is exported under): a warm move writes
# the snapshot, transfers it to the target's agent and restores a worker from it.
SNAPSHOT_PHASES = {
    "snapshot_taken": ("target_reserved", "write"),
    "snapshot_fetched": ("snapshot_taken", "transfer"),
    "target_started": ("snapshot_fetched", "restore"),
}
MOVES = (StepKind.MIGRATE, StepKind.COLD_START)


class MoveSignals:
    """``OperationLog.on_change`` listener: observes each move phase once, when it is reached."""

    def __init__(self, metrics: DaemonMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._reached: dict[tuple[str, int], dict[str, float]] = {}

    def __call__(self, op: Operation) -> None:
        for step in op.steps:
            if step.kind in MOVES:
                self._step(op.id, step)

    def _step(self, op_id: str, step: Step) -> None:
        key = (op_id, step.index)
        if step.state.finished:
            self._reached.pop(key, None)
            return
        reached = self._reached.setdefault(key, {})
        if step.phase in reached:
            return
        now = reached[step.phase] = self._clock()
        if step.kind is StepKind.MIGRATE and step.phase in SNAPSHOT_PHASES:
            since, label = SNAPSHOT_PHASES[step.phase]
            if since in reached:
                self._metrics.snapshot_duration.labels(phase=label).observe(now - reached[since])
        if step.phase == "sessions_copied":
            self._metrics.session_pause.observe(step.max_session_pause_ms / 1000)
