from fleetshift.v1 import fleet_pb2 as _fleet_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_tokens", "max_new_tokens", "sampling", "session_id", "stop_token_ids", "resume_session_id", "resume_from_token", "hold_after_tokens", "tokens_per_message")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOLD_AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: WorkerSampling
    session_id: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_session_id: str
    resume_from_token: int
    hold_after_tokens: int
    tokens_per_message: int
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., session_id: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., resume_session_id: _Optional[str] = ..., resume_from_token: _Optional[int] = ..., hold_after_tokens: _Optional[int] = ..., tokens_per_message: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "token", "index", "finished", "finish_reason", "more_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token: int
    index: int
    finished: bool
    finish_reason: str
    more_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., token: _Optional[int] = ..., index: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., more_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerPauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerResumeRequest(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class WorkerRunState(_message.Message):
    __slots__ = ("paused", "steps")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    steps: int
    def __init__(self, paused: _Optional[bool] = ..., steps: _Optional[int] = ...) -> None: ...

class WorkerSnapshotRequest(_message.Message):
    __slots__ = ("dir", "snapshot_id")
    DIR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    dir: str
    snapshot_id: str
    def __init__(self, dir: _Optional[str] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class WorkerSnapshotResponse(_message.Message):
    __slots__ = ("path", "snapshot_id", "session_ids", "size_bytes", "pause_ms", "total_ms", "compiled_artifacts")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    COMPILED_ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    path: str
    snapshot_id: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    size_bytes: int
    pause_ms: float
    total_ms: float
    compiled_artifacts: bool
    def __init__(self, path: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ..., size_bytes: _Optional[int] = ..., pause_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., compiled_artifacts: _Optional[bool] = ...) -> None: ...

class WorkerRestoreRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class WorkerRestoreResponse(_message.Message):
    __slots__ = ("session_ids", "kv_restored", "compat")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_RESTORED_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_restored: _containers.RepeatedScalarFieldContainer[str]
    compat: str
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., kv_restored: _Optional[_Iterable[str]] = ..., compat: _Optional[str] = ...) -> None: ...

class ExportSessionRequest(_message.Message):
    __slots__ = ("session_id", "with_kv", "release", "from_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WITH_KV_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    with_kv: bool
    release: bool
    from_token: int
    def __init__(self, session_id: _Optional[str] = ..., with_kv: _Optional[bool] = ..., release: _Optional[bool] = ..., from_token: _Optional[int] = ...) -> None: ...

class ExportSessionResponse(_message.Message):
    __slots__ = ("blob", "kv_included", "tokens", "generated", "delta")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    KV_INCLUDED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    blob: bytes
    kv_included: bool
    tokens: int
    generated: int
    delta: bool
    def __init__(self, blob: _Optional[bytes] = ..., kv_included: _Optional[bool] = ..., tokens: _Optional[int] = ..., generated: _Optional[int] = ..., delta: _Optional[bool] = ...) -> None: ...

class ImportSessionRequest(_message.Message):
    __slots__ = ("blob", "staged", "delta_for")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FOR_FIELD_NUMBER: _ClassVar[int]
    blob: bytes
    staged: bool
    delta_for: str
    def __init__(self, blob: _Optional[bytes] = ..., staged: _Optional[bool] = ..., delta_for: _Optional[str] = ...) -> None: ...

class ImportSessionResponse(_message.Message):
    __slots__ = ("session_id", "kv_restored", "kv_note", "generated", "staged", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KV_RESTORED_FIELD_NUMBER: _ClassVar[int]
    KV_NOTE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kv_restored: bool
    kv_note: str
    generated: int
    staged: bool
    tokens: int
    def __init__(self, session_id: _Optional[str] = ..., kv_restored: _Optional[bool] = ..., kv_note: _Optional[str] = ..., generated: _Optional[int] = ..., staged: _Optional[bool] = ..., tokens: _Optional[int] = ...) -> None: ...

class CancelSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelSessionResponse(_message.Message):
    __slots__ = ("generated",)
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    generated: int
    def __init__(self, generated: _Optional[int] = ...) -> None: ...

class GetWorkerCountersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerCompatKey(_message.Message):
    __slots__ = ("gpu_product", "gpu_count", "compute_capability", "driver_version", "cuda_version", "torch_version", "engine_name", "engine_version", "model_id", "weights_digest", "dtype", "quantization", "tensor_parallel")
    GPU_PRODUCT_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    gpu_product: str
    gpu_count: int
    compute_capability: str
    driver_version: str
    cuda_version: str
    torch_version: str
    engine_name: str
    engine_version: str
    model_id: str
    weights_digest: str
    dtype: str
    quantization: str
    tensor_parallel: int
    def __init__(self, gpu_product: _Optional[str] = ..., gpu_count: _Optional[int] = ..., compute_capability: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., engine_name: _Optional[str] = ..., engine_version: _Optional[str] = ..., model_id: _Optional[str] = ..., weights_digest: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., tensor_parallel: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "model_id", "compat_key", "kv_block_size", "kv_blocks_total", "max_running", "compiled", "paused", "restored_from", "session_ids", "staged_session_ids", "draining", "role_epoch", "unread_session_ids", "finished_sessions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ROLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNREAD_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _fleet_pb2.WorkerRole
    model_id: str
    compat_key: WorkerCompatKey
    kv_block_size: int
    kv_blocks_total: int
    max_running: int
    compiled: bool
    paused: bool
    restored_from: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    staged_session_ids: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    role_epoch: int
    unread_session_ids: _containers.RepeatedScalarFieldContainer[str]
    finished_sessions: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.FinishedSession]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., model_id: _Optional[str] = ..., compat_key: _Optional[_Union[WorkerCompatKey, _Mapping]] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., max_running: _Optional[int] = ..., compiled: _Optional[bool] = ..., paused: _Optional[bool] = ..., restored_from: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ..., staged_session_ids: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., role_epoch: _Optional[int] = ..., unread_session_ids: _Optional[_Iterable[str]] = ..., finished_sessions: _Optional[_Iterable[_Union[_fleet_pb2.FinishedSession, _Mapping]]] = ...) -> None: ...

class SetWorkerRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _fleet_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ...) -> None: ...

class SetWorkerDrainingRequest(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...
