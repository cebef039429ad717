"""The daemon's one protobuf mapping of the shared vocabulary (roles, worker states, dtypes).

Servicers (``api``) and the fleet client (``clients``) both speak it, so it sits below both:
a role is converted to and from the wire in exactly one place on the daemon's side.
"""

from __future__ import annotations

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_common.errors import InvalidArgument
from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.core.perfmodel import Dtype

ROLE_TO_PB = {
    Role.PREFILL: pb.WORKER_ROLE_PREFILL,
    Role.DECODE: pb.WORKER_ROLE_DECODE,
    Role.MIXED: pb.WORKER_ROLE_MIXED,
}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}
WORKER_STATE_TO_PB = {
    WorkerState.STARTING: pb.WORKER_STATE_STARTING,
    WorkerState.SERVING: pb.WORKER_STATE_SERVING,
    WorkerState.DRAINING: pb.WORKER_STATE_DRAINING,
    WorkerState.STOPPED: pb.WORKER_STATE_STOPPED,
    WorkerState.FAILED: pb.WORKER_STATE_FAILED,
}
WORKER_STATE_FROM_PB = {v: k for k, v in WORKER_STATE_TO_PB.items()}


def role_pb(value: Role | None) -> pb.WorkerRole:
    """A role on the wire; none (a step without one) is UNSPECIFIED."""
    return ROLE_TO_PB[value] if value is not None else pb.WORKER_ROLE_UNSPECIFIED


def role(value: int, field: str = "role") -> Role:
    try:
        return ROLE_FROM_PB[value]  # type: ignore[index]
    except KeyError:
        raise InvalidArgument(f"{field} must be PREFILL, DECODE or MIXED", field=field) from None


def dtype(value: str, field: str = "dtype") -> Dtype:
    try:
        return Dtype(value or "bf16")
    except ValueError:
        names = ", ".join(d.value for d in Dtype)
        raise InvalidArgument(
            f"{field} must be one of {names}, got {value!r}", field=field
        ) from None
