"""The agent's one protobuf mapping of the shared vocabulary (roles and worker states).

The agent and its workers store a role by its name (``"decode"``: in launch records, on the
worker's command line), so the tables here are keyed by the vocabulary's values; each is
derived from the one mapping of ``fleetshift_common.vocabulary.Role`` below.
"""

from __future__ import annotations

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift_common.vocabulary import Role, WorkerState

ROLE_TO_PB = {
    Role.PREFILL: pb.WORKER_ROLE_PREFILL,
    Role.DECODE: pb.WORKER_ROLE_DECODE,
    Role.MIXED: pb.WORKER_ROLE_MIXED,
}
ROLE_BY_NAME = {role.value: code for role, code in ROLE_TO_PB.items()}
ROLE_NAME_BY_PB: dict[int, str] = {code: role.value for role, code in ROLE_TO_PB.items()}
STATE_TO_PB = {
    WorkerState.STARTING.value: pb.WORKER_STATE_STARTING,
    WorkerState.SERVING.value: pb.WORKER_STATE_SERVING,
    WorkerState.FAILED.value: pb.WORKER_STATE_FAILED,
    WorkerState.STOPPED.value: pb.WORKER_STATE_STOPPED,
}
