import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SnapshotCompatKey(_message.Message):
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

class SnapshotFieldDifference(_message.Message):
    __slots__ = ("field", "snapshot", "destination")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    field: str
    snapshot: str
    destination: str
    def __init__(self, field: _Optional[str] = ..., snapshot: _Optional[str] = ..., destination: _Optional[str] = ...) -> None: ...

class SnapshotCompatVerdict(_message.Message):
    __slots__ = ("warm_ok", "weights_reusable", "compiled_ok", "differences", "description")
    WARM_OK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REUSABLE_FIELD_NUMBER: _ClassVar[int]
    COMPILED_OK_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    warm_ok: bool
    weights_reusable: bool
    compiled_ok: bool
    differences: _containers.RepeatedCompositeFieldContainer[SnapshotFieldDifference]
    description: str
    def __init__(self, warm_ok: _Optional[bool] = ..., weights_reusable: _Optional[bool] = ..., compiled_ok: _Optional[bool] = ..., differences: _Optional[_Iterable[_Union[SnapshotFieldDifference, _Mapping]]] = ..., description: _Optional[str] = ...) -> None: ...

class SnapshotFile(_message.Message):
    __slots__ = ("name", "size_bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SnapshotSummary(_message.Message):
    __slots__ = ("snapshot_id", "size_bytes", "created_at", "key", "key_summary", "pinned", "in_use")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    KEY_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    size_bytes: int
    created_at: _timestamp_pb2.Timestamp
    key: SnapshotCompatKey
    key_summary: str
    pinned: bool
    in_use: bool
    def __init__(self, snapshot_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., key: _Optional[_Union[SnapshotCompatKey, _Mapping]] = ..., key_summary: _Optional[str] = ..., pinned: _Optional[bool] = ..., in_use: _Optional[bool] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotSummary]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotSummary, _Mapping]]] = ...) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class SnapshotDetail(_message.Message):
    __slots__ = ("summary", "files", "manifest", "manifest_sha256", "spec_json")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    summary: SnapshotSummary
    files: _containers.RepeatedCompositeFieldContainer[SnapshotFile]
    manifest: bytes
    manifest_sha256: str
    spec_json: str
    def __init__(self, summary: _Optional[_Union[SnapshotSummary, _Mapping]] = ..., files: _Optional[_Iterable[_Union[SnapshotFile, _Mapping]]] = ..., manifest: _Optional[bytes] = ..., manifest_sha256: _Optional[str] = ..., spec_json: _Optional[str] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class DeleteSnapshotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "file", "offset", "chunk_size")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    file: str
    offset: int
    chunk_size: int
    def __init__(self, snapshot_id: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("file", "offset", "data", "crc32", "last")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    data: bytes
    crc32: int
    last: bool
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class CheckCompatibilityRequest(_message.Message):
    __slots__ = ("snapshot_id", "destination", "node_name", "source_agent_address")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    destination: SnapshotCompatKey
    node_name: str
    source_agent_address: str
    def __init__(self, snapshot_id: _Optional[str] = ..., destination: _Optional[_Union[SnapshotCompatKey, _Mapping]] = ..., node_name: _Optional[str] = ..., source_agent_address: _Optional[str] = ...) -> None: ...
