import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from fleetshift.v1 import placement_pb2 as _placement_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UploadCalibrationRequest(_message.Message):
    __slots__ = ("model", "gpu_kind", "profile_csv", "model_config_json", "profiled_at")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_KIND_FIELD_NUMBER: _ClassVar[int]
    PROFILE_CSV_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PROFILED_AT_FIELD_NUMBER: _ClassVar[int]
    model: str
    gpu_kind: str
    profile_csv: str
    model_config_json: str
    profiled_at: _timestamp_pb2.Timestamp
    def __init__(self, model: _Optional[str] = ..., gpu_kind: _Optional[str] = ..., profile_csv: _Optional[str] = ..., model_config_json: _Optional[str] = ..., profiled_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PhaseFitError(_message.Message):
    __slots__ = ("phase", "points", "median_abs_pct", "p90_abs_pct", "median_bias_pct")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_ABS_PCT_FIELD_NUMBER: _ClassVar[int]
    P90_ABS_PCT_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_BIAS_PCT_FIELD_NUMBER: _ClassVar[int]
    phase: str
    points: int
    median_abs_pct: float
    p90_abs_pct: float
    median_bias_pct: float
    def __init__(self, phase: _Optional[str] = ..., points: _Optional[int] = ..., median_abs_pct: _Optional[float] = ..., p90_abs_pct: _Optional[float] = ..., median_bias_pct: _Optional[float] = ...) -> None: ...

class ModelCalibration(_message.Message):
    __slots__ = ("model", "gpu_kind", "hardware", "rows", "median_error_pct", "errors", "profiled_at", "uploaded_at", "factors", "description")
    class FactorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_KIND_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_ERROR_PCT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PROFILED_AT_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_AT_FIELD_NUMBER: _ClassVar[int]
    FACTORS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    gpu_kind: str
    hardware: str
    rows: int
    median_error_pct: float
    errors: _containers.RepeatedCompositeFieldContainer[PhaseFitError]
    profiled_at: _timestamp_pb2.Timestamp
    uploaded_at: _timestamp_pb2.Timestamp
    factors: _containers.ScalarMap[str, float]
    description: str
    def __init__(self, model: _Optional[str] = ..., gpu_kind: _Optional[str] = ..., hardware: _Optional[str] = ..., rows: _Optional[int] = ..., median_error_pct: _Optional[float] = ..., errors: _Optional[_Iterable[_Union[PhaseFitError, _Mapping]]] = ..., profiled_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., uploaded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., factors: _Optional[_Mapping[str, float]] = ..., description: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelKind(_message.Message):
    __slots__ = ("basis", "calibration")
    BASIS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    basis: _placement_pb2.PredictionBasis
    calibration: ModelCalibration
    def __init__(self, basis: _Optional[_Union[_placement_pb2.PredictionBasis, _Mapping]] = ..., calibration: _Optional[_Union[ModelCalibration, _Mapping]] = ...) -> None: ...

class ServedModelInfo(_message.Message):
    __slots__ = ("name", "tp_options", "kinds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tp_options: _containers.RepeatedScalarFieldContainer[int]
    kinds: _containers.RepeatedCompositeFieldContainer[ModelKind]
    def __init__(self, name: _Optional[str] = ..., tp_options: _Optional[_Iterable[int]] = ..., kinds: _Optional[_Iterable[_Union[ModelKind, _Mapping]]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ServedModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ServedModelInfo, _Mapping]]] = ...) -> None: ...
