import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from fleetshift.v1 import fleet_pb2 as _fleet_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OperationKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_KIND_UNSPECIFIED: _ClassVar[OperationKind]
    OPERATION_KIND_REBALANCE: _ClassVar[OperationKind]
    OPERATION_KIND_DRAIN: _ClassVar[OperationKind]
    OPERATION_KIND_MOVE_WORKER: _ClassVar[OperationKind]

class OperationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATE_UNSPECIFIED: _ClassVar[OperationState]
    OPERATION_STATE_PENDING: _ClassVar[OperationState]
    OPERATION_STATE_RUNNING: _ClassVar[OperationState]
    OPERATION_STATE_SUCCEEDED: _ClassVar[OperationState]
    OPERATION_STATE_FAILED: _ClassVar[OperationState]
    OPERATION_STATE_CANCELLED: _ClassVar[OperationState]

class StepKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_KIND_UNSPECIFIED: _ClassVar[StepKind]
    STEP_KIND_ROLE_CHANGE: _ClassVar[StepKind]
    STEP_KIND_MIGRATE: _ClassVar[StepKind]
    STEP_KIND_COLD_START: _ClassVar[StepKind]
    STEP_KIND_START: _ClassVar[StepKind]
    STEP_KIND_RETIRE: _ClassVar[StepKind]

class StepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_STATE_UNSPECIFIED: _ClassVar[StepState]
    STEP_STATE_PENDING: _ClassVar[StepState]
    STEP_STATE_RUNNING: _ClassVar[StepState]
    STEP_STATE_DONE: _ClassVar[StepState]
    STEP_STATE_ROLLED_BACK: _ClassVar[StepState]
    STEP_STATE_SKIPPED: _ClassVar[StepState]
OPERATION_KIND_UNSPECIFIED: OperationKind
OPERATION_KIND_REBALANCE: OperationKind
OPERATION_KIND_DRAIN: OperationKind
OPERATION_KIND_MOVE_WORKER: OperationKind
OPERATION_STATE_UNSPECIFIED: OperationState
OPERATION_STATE_PENDING: OperationState
OPERATION_STATE_RUNNING: OperationState
OPERATION_STATE_SUCCEEDED: OperationState
OPERATION_STATE_FAILED: OperationState
OPERATION_STATE_CANCELLED: OperationState
STEP_KIND_UNSPECIFIED: StepKind
STEP_KIND_ROLE_CHANGE: StepKind
STEP_KIND_MIGRATE: StepKind
STEP_KIND_COLD_START: StepKind
STEP_KIND_START: StepKind
STEP_KIND_RETIRE: StepKind
STEP_STATE_UNSPECIFIED: StepState
STEP_STATE_PENDING: StepState
STEP_STATE_RUNNING: StepState
STEP_STATE_DONE: StepState
STEP_STATE_ROLLED_BACK: StepState
STEP_STATE_SKIPPED: StepState

class OperationStep(_message.Message):
    __slots__ = ("index", "kind", "worker_id", "target_node", "target_role", "target_gpus", "phase", "state", "new_worker_id", "snapshot_id", "bytes_moved", "sessions_carried", "max_session_pause_ms", "started_at", "finished_at", "error", "sessions_kv_restored")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_GPUS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEW_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CARRIED_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_KV_RESTORED_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: StepKind
    worker_id: str
    target_node: str
    target_role: _fleet_pb2.WorkerRole
    target_gpus: _containers.RepeatedScalarFieldContainer[int]
    phase: str
    state: StepState
    new_worker_id: str
    snapshot_id: str
    bytes_moved: int
    sessions_carried: int
    max_session_pause_ms: float
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    error: str
    sessions_kv_restored: int
    def __init__(self, index: _Optional[int] = ..., kind: _Optional[_Union[StepKind, str]] = ..., worker_id: _Optional[str] = ..., target_node: _Optional[str] = ..., target_role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., target_gpus: _Optional[_Iterable[int]] = ..., phase: _Optional[str] = ..., state: _Optional[_Union[StepState, str]] = ..., new_worker_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., bytes_moved: _Optional[int] = ..., sessions_carried: _Optional[int] = ..., max_session_pause_ms: _Optional[float] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., sessions_kv_restored: _Optional[int] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("id", "kind", "state", "requested_by", "reason", "idempotency_key", "steps", "created_at", "updated_at", "error", "cancel_requested", "bytes_moved", "sessions_carried")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CARRIED_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: OperationKind
    state: OperationState
    requested_by: str
    reason: str
    idempotency_key: str
    steps: _containers.RepeatedCompositeFieldContainer[OperationStep]
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    error: str
    cancel_requested: bool
    bytes_moved: int
    sessions_carried: int
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[OperationKind, str]] = ..., state: _Optional[_Union[OperationState, str]] = ..., requested_by: _Optional[str] = ..., reason: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[OperationStep, _Mapping]]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., cancel_requested: _Optional[bool] = ..., bytes_moved: _Optional[int] = ..., sessions_carried: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("idempotency_key", "reason")
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    idempotency_key: str
    reason: str
    def __init__(self, idempotency_key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_name", "idempotency_key", "reason")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    idempotency_key: str
    reason: str
    def __init__(self, node_name: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class MoveWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "target_node", "target_gpus", "target_role", "idempotency_key", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_GPUS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ROLE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    target_node: str
    target_gpus: _containers.RepeatedScalarFieldContainer[int]
    target_role: _fleet_pb2.WorkerRole
    idempotency_key: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., target_node: _Optional[str] = ..., target_gpus: _Optional[_Iterable[int]] = ..., target_role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., idempotency_key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StartFleetWorkerRequest(_message.Message):
    __slots__ = ("model", "role", "tensor_parallel", "dtype", "node_name", "gpu_indices")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    model: str
    role: _fleet_pb2.WorkerRole
    tensor_parallel: int
    dtype: str
    node_name: str
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., tensor_parallel: _Optional[int] = ..., dtype: _Optional[str] = ..., node_name: _Optional[str] = ..., gpu_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class StopFleetWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class ListOperationsRequest(_message.Message):
    __slots__ = ("limit", "unfinished_only")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_ONLY_FIELD_NUMBER: _ClassVar[int]
    limit: int
    unfinished_only: bool
    def __init__(self, limit: _Optional[int] = ..., unfinished_only: _Optional[bool] = ...) -> None: ...

class ListOperationsResponse(_message.Message):
    __slots__ = ("operations",)
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    operations: _containers.RepeatedCompositeFieldContainer[Operation]
    def __init__(self, operations: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ...) -> None: ...

class WatchOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class CancelOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class LocateSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionLocation(_message.Message):
    __slots__ = ("session_id", "worker_id", "endpoint", "node_name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    worker_id: str
    endpoint: str
    node_name: str
    def __init__(self, session_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., node_name: _Optional[str] = ...) -> None: ...
