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

class MoveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOVE_KIND_UNSPECIFIED: _ClassVar[MoveKind]
    MOVE_KIND_ROLE_CHANGE: _ClassVar[MoveKind]
    MOVE_KIND_MIGRATE: _ClassVar[MoveKind]
    MOVE_KIND_COLD_START: _ClassVar[MoveKind]
    MOVE_KIND_START: _ClassVar[MoveKind]
    MOVE_KIND_STOP: _ClassVar[MoveKind]
MOVE_KIND_UNSPECIFIED: MoveKind
MOVE_KIND_ROLE_CHANGE: MoveKind
MOVE_KIND_MIGRATE: MoveKind
MOVE_KIND_COLD_START: MoveKind
MOVE_KIND_START: MoveKind
MOVE_KIND_STOP: MoveKind

class Slo(_message.Message):
    __slots__ = ("ttft_ms", "tbt_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tbt_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tbt_ms: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model", "prompt_tokens", "expected_output_tokens", "slo", "preferred_worker_id", "reroute")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REROUTE_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_tokens: int
    expected_output_tokens: int
    slo: Slo
    preferred_worker_id: str
    reroute: bool
    def __init__(self, model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., preferred_worker_id: _Optional[str] = ..., reroute: _Optional[bool] = ...) -> None: ...

class ScoreTerms(_message.Message):
    __slots__ = ("phase_fit", "latency", "load", "kv_headroom", "health", "affinity", "total", "predicted_ttft_ms", "predicted_tbt_ms")
    PHASE_FIT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_HEADROOM_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TBT_MS_FIELD_NUMBER: _ClassVar[int]
    phase_fit: float
    latency: float
    load: float
    kv_headroom: float
    health: float
    affinity: float
    total: float
    predicted_ttft_ms: float
    predicted_tbt_ms: float
    def __init__(self, phase_fit: _Optional[float] = ..., latency: _Optional[float] = ..., load: _Optional[float] = ..., kv_headroom: _Optional[float] = ..., health: _Optional[float] = ..., affinity: _Optional[float] = ..., total: _Optional[float] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tbt_ms: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "endpoint", "node_name", "decode_worker_id", "decode_endpoint", "reason", "terms", "output_tokens", "output_estimated")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    node_name: str
    decode_worker_id: str
    decode_endpoint: str
    reason: str
    terms: ScoreTerms
    output_tokens: float
    output_estimated: bool
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., node_name: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_endpoint: _Optional[str] = ..., reason: _Optional[str] = ..., terms: _Optional[_Union[ScoreTerms, _Mapping]] = ..., output_tokens: _Optional[float] = ..., output_estimated: _Optional[bool] = ...) -> None: ...

class RouteStreamItem(_message.Message):
    __slots__ = ("id", "route")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    id: int
    route: RouteRequest
    def __init__(self, id: _Optional[int] = ..., route: _Optional[_Union[RouteRequest, _Mapping]] = ...) -> None: ...

class RouteStreamRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RouteStreamItem]
    def __init__(self, requests: _Optional[_Iterable[_Union[RouteStreamItem, _Mapping]]] = ...) -> None: ...

class RouteError(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class RouteStreamAnswer(_message.Message):
    __slots__ = ("id", "route", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    route: RouteResponse
    error: RouteError
    def __init__(self, id: _Optional[int] = ..., route: _Optional[_Union[RouteResponse, _Mapping]] = ..., error: _Optional[_Union[RouteError, _Mapping]] = ...) -> None: ...

class RouteStreamResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[RouteStreamAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[RouteStreamAnswer, _Mapping]]] = ...) -> None: ...

class PlaceWorkerRequest(_message.Message):
    __slots__ = ("model", "role", "tensor_parallel", "dtype", "prefer_gpu_kind")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFER_GPU_KIND_FIELD_NUMBER: _ClassVar[int]
    model: str
    role: _fleet_pb2.WorkerRole
    tensor_parallel: int
    dtype: str
    prefer_gpu_kind: str
    def __init__(self, model: _Optional[str] = ..., role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., tensor_parallel: _Optional[int] = ..., dtype: _Optional[str] = ..., prefer_gpu_kind: _Optional[str] = ...) -> None: ...

class PlaceWorkerResponse(_message.Message):
    __slots__ = ("node_name", "gpu_indices", "gpu_kind", "warm_snapshot_id", "reason")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    GPU_KIND_FIELD_NUMBER: _ClassVar[int]
    WARM_SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    gpu_kind: str
    warm_snapshot_id: str
    reason: str
    def __init__(self, node_name: _Optional[str] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., gpu_kind: _Optional[str] = ..., warm_snapshot_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetEfficiencyRequest(_message.Message):
    __slots__ = ("history",)
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    history: int
    def __init__(self, history: _Optional[int] = ...) -> None: ...

class EfficiencySample(_message.Message):
    __slots__ = ("taken_at", "efficiency", "current_goodput_tokens_per_s", "best_goodput_tokens_per_s", "plan_proposed")
    TAKEN_AT_FIELD_NUMBER: _ClassVar[int]
    EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GOODPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BEST_GOODPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    taken_at: _timestamp_pb2.Timestamp
    efficiency: float
    current_goodput_tokens_per_s: float
    best_goodput_tokens_per_s: float
    plan_proposed: bool
    def __init__(self, taken_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., efficiency: _Optional[float] = ..., current_goodput_tokens_per_s: _Optional[float] = ..., best_goodput_tokens_per_s: _Optional[float] = ..., plan_proposed: _Optional[bool] = ...) -> None: ...

class PredictionBasis(_message.Message):
    __slots__ = ("model", "gpu_kind", "measured", "description")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_KIND_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    gpu_kind: str
    measured: bool
    description: str
    def __init__(self, model: _Optional[str] = ..., gpu_kind: _Optional[str] = ..., measured: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class EfficiencyReport(_message.Message):
    __slots__ = ("latest", "history", "threshold", "below_threshold_for_s", "predictions", "planner_enabled", "note", "measured_slo_reported", "measured_slo_attainment", "predicted_slo_attainment", "slo_attainment_target")
    LATEST_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    BELOW_THRESHOLD_FOR_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_ENABLED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SLO_REPORTED_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_TARGET_FIELD_NUMBER: _ClassVar[int]
    latest: EfficiencySample
    history: _containers.RepeatedCompositeFieldContainer[EfficiencySample]
    threshold: float
    below_threshold_for_s: float
    predictions: _containers.RepeatedCompositeFieldContainer[PredictionBasis]
    planner_enabled: bool
    note: str
    measured_slo_reported: bool
    measured_slo_attainment: float
    predicted_slo_attainment: float
    slo_attainment_target: float
    def __init__(self, latest: _Optional[_Union[EfficiencySample, _Mapping]] = ..., history: _Optional[_Iterable[_Union[EfficiencySample, _Mapping]]] = ..., threshold: _Optional[float] = ..., below_threshold_for_s: _Optional[float] = ..., predictions: _Optional[_Iterable[_Union[PredictionBasis, _Mapping]]] = ..., planner_enabled: _Optional[bool] = ..., note: _Optional[str] = ..., measured_slo_reported: _Optional[bool] = ..., measured_slo_attainment: _Optional[float] = ..., predicted_slo_attainment: _Optional[float] = ..., slo_attainment_target: _Optional[float] = ...) -> None: ...

class GetTrafficMixRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LengthStats(_message.Message):
    __slots__ = ("mean", "p50", "p90")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    mean: float
    p50: float
    p90: float
    def __init__(self, mean: _Optional[float] = ..., p50: _Optional[float] = ..., p90: _Optional[float] = ...) -> None: ...

class ModelTraffic(_message.Message):
    __slots__ = ("model", "arrival_rate_per_s", "prompt_tokens", "output_tokens", "prefill_decode_ratio", "requests_in_window", "estimator_mae_tokens", "estimator_samples", "estimator_baseline_mae_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DECODE_RATIO_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_MAE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_BASELINE_MAE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    arrival_rate_per_s: float
    prompt_tokens: LengthStats
    output_tokens: LengthStats
    prefill_decode_ratio: float
    requests_in_window: int
    estimator_mae_tokens: float
    estimator_samples: int
    estimator_baseline_mae_tokens: float
    def __init__(self, model: _Optional[str] = ..., arrival_rate_per_s: _Optional[float] = ..., prompt_tokens: _Optional[_Union[LengthStats, _Mapping]] = ..., output_tokens: _Optional[_Union[LengthStats, _Mapping]] = ..., prefill_decode_ratio: _Optional[float] = ..., requests_in_window: _Optional[int] = ..., estimator_mae_tokens: _Optional[float] = ..., estimator_samples: _Optional[int] = ..., estimator_baseline_mae_tokens: _Optional[float] = ...) -> None: ...

class TrafficMix(_message.Message):
    __slots__ = ("models", "window_s")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelTraffic]
    window_s: float
    def __init__(self, models: _Optional[_Iterable[_Union[ModelTraffic, _Mapping]]] = ..., window_s: _Optional[float] = ...) -> None: ...

class PlanRebalanceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlannedWorker(_message.Message):
    __slots__ = ("worker_id", "model", "role", "gpu_kind", "tensor_parallel", "dtype", "node_name", "engine", "tensor_parallel_nominal")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GPU_KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_NOMINAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    role: _fleet_pb2.WorkerRole
    gpu_kind: str
    tensor_parallel: int
    dtype: str
    node_name: str
    engine: str
    tensor_parallel_nominal: bool
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[_Union[_fleet_pb2.WorkerRole, str]] = ..., gpu_kind: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., dtype: _Optional[str] = ..., node_name: _Optional[str] = ..., engine: _Optional[str] = ..., tensor_parallel_nominal: _Optional[bool] = ...) -> None: ...

class PlannedMove(_message.Message):
    __slots__ = ("kind", "model", "source", "target", "bytes_to_move", "duration_s", "expected_pause_s", "sessions_affected", "predicted_gain_tokens_per_s", "cost_tokens", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_AFFECTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    COST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: MoveKind
    model: str
    source: PlannedWorker
    target: PlannedWorker
    bytes_to_move: int
    duration_s: float
    expected_pause_s: float
    sessions_affected: int
    predicted_gain_tokens_per_s: float
    cost_tokens: float
    reason: str
    def __init__(self, kind: _Optional[_Union[MoveKind, str]] = ..., model: _Optional[str] = ..., source: _Optional[_Union[PlannedWorker, _Mapping]] = ..., target: _Optional[_Union[PlannedWorker, _Mapping]] = ..., bytes_to_move: _Optional[int] = ..., duration_s: _Optional[float] = ..., expected_pause_s: _Optional[float] = ..., sessions_affected: _Optional[int] = ..., predicted_gain_tokens_per_s: _Optional[float] = ..., cost_tokens: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("moves", "efficiency_before", "goodput_before_tokens_per_s", "goodput_after_tokens_per_s", "bytes_to_move", "pays_off", "solver_status", "solve_s", "predictions", "would_propose", "decision_reason")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    EFFICIENCY_BEFORE_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_BEFORE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_AFTER_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    PAYS_OFF_FIELD_NUMBER: _ClassVar[int]
    SOLVER_STATUS_FIELD_NUMBER: _ClassVar[int]
    SOLVE_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    WOULD_PROPOSE_FIELD_NUMBER: _ClassVar[int]
    DECISION_REASON_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[PlannedMove]
    efficiency_before: float
    goodput_before_tokens_per_s: float
    goodput_after_tokens_per_s: float
    bytes_to_move: int
    pays_off: bool
    solver_status: str
    solve_s: float
    predictions: _containers.RepeatedCompositeFieldContainer[PredictionBasis]
    would_propose: bool
    decision_reason: str
    def __init__(self, moves: _Optional[_Iterable[_Union[PlannedMove, _Mapping]]] = ..., efficiency_before: _Optional[float] = ..., goodput_before_tokens_per_s: _Optional[float] = ..., goodput_after_tokens_per_s: _Optional[float] = ..., bytes_to_move: _Optional[int] = ..., pays_off: _Optional[bool] = ..., solver_status: _Optional[str] = ..., solve_s: _Optional[float] = ..., predictions: _Optional[_Iterable[_Union[PredictionBasis, _Mapping]]] = ..., would_propose: _Optional[bool] = ..., decision_reason: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("node_name", "model")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    model: str
    def __init__(self, node_name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_fleet_pb2.WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[_fleet_pb2.WorkerStatus, _Mapping]]] = ...) -> None: ...
