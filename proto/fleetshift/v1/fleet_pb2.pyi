import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InventorySource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVENTORY_SOURCE_UNSPECIFIED: _ClassVar[InventorySource]
    INVENTORY_SOURCE_NVML: _ClassVar[InventorySource]
    INVENTORY_SOURCE_DECLARED: _ClassVar[InventorySource]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_READY: _ClassVar[NodeState]
    NODE_STATE_LOST: _ClassVar[NodeState]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_MIXED: _ClassVar[WorkerRole]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
INVENTORY_SOURCE_UNSPECIFIED: InventorySource
INVENTORY_SOURCE_NVML: InventorySource
INVENTORY_SOURCE_DECLARED: InventorySource
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_READY: NodeState
NODE_STATE_LOST: NodeState
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_MIXED: WorkerRole
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_FAILED: WorkerState

class Gpu(_message.Message):
    __slots__ = ("index", "product_name", "memory_bytes", "bandwidth_class", "compute_capability", "fp8_supported", "nvlink_peers", "uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PRODUCT_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_CLASS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    FP8_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    NVLINK_PEERS_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    product_name: str
    memory_bytes: int
    bandwidth_class: str
    compute_capability: str
    fp8_supported: bool
    nvlink_peers: _containers.RepeatedScalarFieldContainer[int]
    uuid: str
    def __init__(self, index: _Optional[int] = ..., product_name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., bandwidth_class: _Optional[str] = ..., compute_capability: _Optional[str] = ..., fp8_supported: _Optional[bool] = ..., nvlink_peers: _Optional[_Iterable[int]] = ..., uuid: _Optional[str] = ...) -> None: ...

class NodeVersions(_message.Message):
    __slots__ = ("driver", "cuda", "torch", "agent")
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    driver: str
    cuda: str
    torch: str
    agent: str
    def __init__(self, driver: _Optional[str] = ..., cuda: _Optional[str] = ..., torch: _Optional[str] = ..., agent: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_name", "agent_address", "gpus", "versions", "inventory_source")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    agent_address: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    versions: NodeVersions
    inventory_source: InventorySource
    def __init__(self, node_name: _Optional[str] = ..., agent_address: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., versions: _Optional[_Union[NodeVersions, _Mapping]] = ..., inventory_source: _Optional[_Union[InventorySource, str]] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "agent_address", "state", "cordoned", "inventory_source", "versions", "gpus", "registered_at", "last_heartbeat_at", "cordon_reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AT_FIELD_NUMBER: _ClassVar[int]
    CORDON_REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    agent_address: str
    state: NodeState
    cordoned: bool
    inventory_source: InventorySource
    versions: NodeVersions
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    registered_at: _timestamp_pb2.Timestamp
    last_heartbeat_at: _timestamp_pb2.Timestamp
    cordon_reason: str
    def __init__(self, name: _Optional[str] = ..., agent_address: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., cordoned: _Optional[bool] = ..., inventory_source: _Optional[_Union[InventorySource, str]] = ..., versions: _Optional[_Union[NodeVersions, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_heartbeat_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cordon_reason: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node", "heartbeat_interval_ms", "created")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    node: Node
    heartbeat_interval_ms: int
    created: bool
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., heartbeat_interval_ms: _Optional[int] = ..., created: _Optional[bool] = ...) -> None: ...

class WorkerCounters(_message.Message):
    __slots__ = ("worker_id", "prefill_tokens", "decode_tokens", "queue_depth", "kv_blocks_used", "kv_blocks_total", "live_sessions", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    prefill_tokens: int
    decode_tokens: int
    queue_depth: int
    kv_blocks_used: int
    kv_blocks_total: int
    live_sessions: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tbt_p50_ms: float
    tbt_p99_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., live_sessions: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., tbt_p50_ms: _Optional[float] = ..., tbt_p99_ms: _Optional[float] = ...) -> None: ...

class FinishedSession(_message.Message):
    __slots__ = ("session_id", "prompt_tokens", "output_tokens", "finish_reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "model", "role", "tensor_parallel", "dtype", "gpu_indices", "endpoint", "state", "origin_snapshot", "counters", "session_ids", "role_epoch", "node_name", "restore_compat", "engine", "tensor_parallel_nominal", "unread_session_ids", "finished_sessions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    RESTORE_COMPAT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_NOMINAL_FIELD_NUMBER: _ClassVar[int]
    UNREAD_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    role: WorkerRole
    tensor_parallel: int
    dtype: str
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    endpoint: str
    state: WorkerState
    origin_snapshot: str
    counters: WorkerCounters
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    role_epoch: int
    node_name: str
    restore_compat: str
    engine: str
    tensor_parallel_nominal: bool
    unread_session_ids: _containers.RepeatedScalarFieldContainer[str]
    finished_sessions: _containers.RepeatedCompositeFieldContainer[FinishedSession]
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., tensor_parallel: _Optional[int] = ..., dtype: _Optional[str] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., endpoint: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., origin_snapshot: _Optional[str] = ..., counters: _Optional[_Union[WorkerCounters, _Mapping]] = ..., session_ids: _Optional[_Iterable[str]] = ..., role_epoch: _Optional[int] = ..., node_name: _Optional[str] = ..., restore_compat: _Optional[str] = ..., engine: _Optional[str] = ..., tensor_parallel_nominal: _Optional[bool] = ..., unread_session_ids: _Optional[_Iterable[str]] = ..., finished_sessions: _Optional[_Iterable[_Union[FinishedSession, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_name", "workers")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, node_name: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state", "cordoned")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    state: NodeState
    cordoned: bool
    def __init__(self, state: _Optional[_Union[NodeState, str]] = ..., cordoned: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("state", "gpu_product_contains")
    STATE_FIELD_NUMBER: _ClassVar[int]
    GPU_PRODUCT_CONTAINS_FIELD_NUMBER: _ClassVar[int]
    state: NodeState
    gpu_product_contains: str
    def __init__(self, state: _Optional[_Union[NodeState, str]] = ..., gpu_product_contains: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_name",)
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    def __init__(self, node_name: _Optional[str] = ...) -> None: ...

class CordonNodeRequest(_message.Message):
    __slots__ = ("node_name", "reason")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    reason: str
    def __init__(self, node_name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UncordonNodeRequest(_message.Message):
    __slots__ = ("node_name",)
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    def __init__(self, node_name: _Optional[str] = ...) -> None: ...
