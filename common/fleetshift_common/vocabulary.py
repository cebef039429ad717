"""The words every part of FleetShift uses for workers and moves, defined once.

Roles, worker states and the phases of a move are written to the database, sent over the wire
and compared in the phase machine; with one definition each there is no second table to drift
out of step (each side keeps exactly one protobuf mapping, at its boundary). Dtypes are the
performance model's (``fleetshift_daemon.core.perfmodel.Dtype``): the model owns what a dtype
costs.
"""

from __future__ import annotations

import enum


class Role(enum.Enum):
    """What a worker serves: a request's prefill, its decode, or both."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class WorkerState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # a move or a retirement is taking its sessions away
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def alive(self) -> bool:
        return self in (WorkerState.STARTING, WorkerState.SERVING, WorkerState.DRAINING)


class StepPhase(enum.StrEnum):
    """The last phase a step of an operation completed, in the order a step passes them.

    A string enum: the phase is stored as its value in the operation log's JSON and shown to
    operators as is (``GetOperation``'s ``phase``).
    """

    PLANNED = "planned"
    DRAINING = "draining"  # a retirement: no new sessions, waiting for the live ones to end
    TARGET_RESERVED = "target_reserved"
    SNAPSHOT_TAKEN = "snapshot_taken"
    SNAPSHOT_FETCHED = "snapshot_fetched"
    TARGET_STARTED = "target_started"
    SOURCE_PAUSED = "source_paused"
    SESSIONS_COPIED = "sessions_copied"
    SWITCHED = "switched"
    SOURCE_RETIRED = "source_retired"
    DONE = "done"

    @property
    def rank(self) -> int:
        """Position in the order above (``planned`` is 0)."""
        return _ORDER.index(self)


_ORDER = tuple(StepPhase)
