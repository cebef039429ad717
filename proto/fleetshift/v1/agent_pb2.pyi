from fleetshift.v1 import fleet_pb2 as _fleet_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetAgentInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("node_name", "gpus", "versions", "inventory_source", "daemon_address", "registered", "workers", "engines", "engine_notes")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NOTES_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    gpus: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.Gpu]
    versions: _fleet_pb2.NodeVersions
    inventory_source: _fleet_pb2.InventorySource
    daemon_address: str
    registered: bool
    workers: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.WorkerStatus]
    engines: _containers.RepeatedScalarFieldContainer[str]
    engine_notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_name: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[_fleet_pb2.Gpu, _Mapping]]] = ..., versions: _Optional[_Union[_fleet_pb2.NodeVersions, _Mapping]] = ..., inventory_source: _Optional[_Union[_fleet_pb2.InventorySource, str]] = ..., daemon_address: _Optional[str] = ..., registered: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[_fleet_pb2.WorkerStatus, _Mapping]]] = ..., engines: _Optional[_Iterable[str]] = ..., engine_notes: _Optional[_Iterable[str]] = ...) -> None: ...

class StartWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "model", "model_dir", "role", "tensor_parallel", "dtype", "gpu_indices", "restore_snapshot_id", "engine", "engine_args_json")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    model_dir: str
    role: _fleet_pb2.WorkerRole
    tensor_parallel: int
    dtype: str
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    restore_snapshot_id: str
    engine: str
    engine_args_json: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., model_dir: _Optional[str] = ..., role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., tensor_parallel: _Optional[int] = ..., dtype: _Optional[str] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., restore_snapshot_id: _Optional[str] = ..., engine: _Optional[str] = ..., engine_args_json: _Optional[str] = ...) -> None: ...

class StopWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "grace_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    grace_s: float
    def __init__(self, worker_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class SnapshotWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "snapshot_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    snapshot_id: str
    def __init__(self, worker_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class SnapshotWorkerResponse(_message.Message):
    __slots__ = ("snapshot_id", "size_bytes", "pause_ms", "total_ms", "session_ids")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    size_bytes: int
    pause_ms: float
    total_ms: float
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, snapshot_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., pause_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchSnapshotRequest(_message.Message):
    __slots__ = ("source_agent_address", "snapshot_id")
    SOURCE_AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    source_agent_address: str
    snapshot_id: str
    def __init__(self, source_agent_address: _Optional[str] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class FetchSnapshotResponse(_message.Message):
    __slots__ = ("snapshot_id", "bytes_received", "size_bytes", "seconds")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    bytes_received: int
    size_bytes: int
    seconds: float
    def __init__(self, snapshot_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., size_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
