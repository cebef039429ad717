"""Calibrations per (model, GPU kind): a profile the operator uploads, fitted, kept, and shown.

A prediction for a model on a GPU kind is either *measured* (fitted on a profile of that model
on that kind, e.g. from ``fleetshift profile``) or *predicted from hardware figures, not
measured* (the transferable per-kind factors). Operators must be able to tell which, wherever a
prediction is shown, so each calibration carries what it was fitted on and how well it fits.

A profile is refused whole (nothing stored, nothing changed) when its model or GPU kind is not
configured, when the CSV is not of the reference table's shape, when it was measured on other
hardware than the kind it claims to calibrate (a CPU profile never calibrates a GPU kind), or
when the fit fails.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import numpy as np

from fleetshift_common.errors import FleetShiftError, InvalidArgument, NotFound
from fleetshift_daemon.core import calibration
from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.errors import InvalidModelArch
from fleetshift_daemon.core.gpus import GpuCatalogue, GpuKind
from fleetshift_daemon.core.measurements import REQUIRED_COLUMNS
from fleetshift_daemon.core.perf_factors import CalibrationKey, EfficiencyFactors, KindFactors
from fleetshift_daemon.core.perfmodel import Dtype, PerfModel, dtype_of_config

PREDICTED = "predicted from hardware figures, not measured"
PROFILE_FIELD = "profile_csv"
COLUMNS = REQUIRED_COLUMNS  # the reference table's shape, as the file loader reads it
MAX_ROWS = 100_000


@dataclass(frozen=True)
class ProfileRow:
    hardware: str
    tp: int
    prompt_size: int
    batch_size: int
    token_size: int
    prompt_s: float
    token_s: float


@dataclass(frozen=True)
class PhaseError:
    phase: str
    points: int
    median_abs_pct: float
    p90_abs_pct: float
    median_bias_pct: float


@dataclass(frozen=True)
class Calibration:
    model: str
    gpu_kind: str
    factors: KindFactors
    hardware: str  # the profile's hardware column, as measured
    rows: int  # CSV rows, repeats included
    median_error_pct: float  # in-sample: the fit's own error over every point of the profile
    errors: tuple[PhaseError, ...]
    profiled_at: float  # epoch seconds: the sidecar's date, else the upload's
    uploaded_at: float

    @property
    def key(self) -> CalibrationKey:
        return (self.model, self.gpu_kind)

    def describe(self) -> str:
        day = datetime.fromtimestamp(self.profiled_at, UTC).date().isoformat()
        return (
            f"measured (profile of {day}, {self.rows} rows, median error "
            f"{self.median_error_pct:.1f} %)"
        )


class CalibrationStore(Protocol):
    def all(self) -> Sequence[Calibration]: ...

    def put(self, calibration: Calibration) -> None: ...


class _KindMeasurement(calibration.Measurement):
    """A measurement of a named catalogue kind (the reference file's loader only knows its
    three hardware names)."""

    gpu: GpuKind

    def __init__(self, gpu: GpuKind, **values: object) -> None:
        super().__init__(**values)  # type: ignore[arg-type]
        object.__setattr__(self, "gpu", gpu)

    @property
    def kind(self) -> GpuKind:
        return self.gpu


def parse_profile(text: str) -> list[ProfileRow]:
    """Rows of a CSV of the reference table's shape; every error names the line and column."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise InvalidArgument(
            f"{PROFILE_FIELD}: the header lacks column {missing[0]!r} (a profile has "
            f"{', '.join(COLUMNS)})",
            field=PROFILE_FIELD,
        )
    rows = [_row(raw, line) for line, raw in enumerate(reader, start=2)]
    if not rows:
        raise InvalidArgument(f"{PROFILE_FIELD}: no rows after the header", field=PROFILE_FIELD)
    if len(rows) > MAX_ROWS:
        raise InvalidArgument(
            f"{PROFILE_FIELD}: {len(rows)} rows, at most {MAX_ROWS}", field=PROFILE_FIELD
        )
    kinds = sorted({r.hardware for r in rows})
    if len(kinds) > 1:
        raise InvalidArgument(
            f"{PROFILE_FIELD}: one profile is one hardware kind; this one has {kinds}",
            field=PROFILE_FIELD,
        )
    return rows


def _row(raw: Mapping[str, str | None], line: int) -> ProfileRow:
    def number(name: str, kind: type[int] | type[float]) -> float:
        text = (raw.get(name) or "").strip()
        try:
            value = kind(text)
        except ValueError:
            raise InvalidArgument(
                f"{PROFILE_FIELD}: line {line}, {name} {text!r} is not a number",
                field=PROFILE_FIELD,
            ) from None
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgument(
                f"{PROFILE_FIELD}: line {line}, {name} must be > 0, got {text}",
                field=PROFILE_FIELD,
            )
        return value

    hardware = (raw.get("hardware") or "").strip()
    if not hardware:
        raise InvalidArgument(
            f"{PROFILE_FIELD}: line {line}, hardware is empty", field=PROFILE_FIELD
        )
    return ProfileRow(
        hardware=hardware,
        tp=int(number("tensor_parallel", int)),
        prompt_size=int(number("prompt_size", int)),
        batch_size=int(number("batch_size", int)),
        token_size=int(number("token_size", int)),
        prompt_s=number("prompt_time", float) / 1e3,
        token_s=number("token_time", float) / 1e3,
    )


def check_hardware(hardware: str, kind: GpuKind) -> None:
    """A profile calibrates only the kind it was measured on: a ``cpu-...`` profile never a
    GPU kind, and a reference-table name (``h100-80gb``) only the kind it stands for."""
    if hardware.lower().startswith("cpu") and not kind.name.lower().startswith("cpu"):
        raise InvalidArgument(
            f"{PROFILE_FIELD}: hardware {hardware!r} was measured on a CPU; it cannot calibrate "
            f"GPU kind {kind.name!r}",
            field=PROFILE_FIELD,
        )
    named = calibration.HARDWARE_KINDS.get(hardware)
    if named is not None and named.name != kind.name:
        raise InvalidArgument(
            f"{PROFILE_FIELD}: hardware {hardware!r} is {named.name}, not gpu_kind {kind.name!r}",
            field="gpu_kind",
        )


def measurements(rows: Iterable[ProfileRow], kind: GpuKind) -> list[calibration.Measurement]:
    """Medians over repeats, as the reference loader takes them."""
    prefill: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[int, int, int, int], list[float]] = defaultdict(list)
    for r in rows:
        prefill[(r.tp, r.prompt_size, r.batch_size)].append(r.prompt_s)
        decode[(r.tp, r.prompt_size, r.batch_size, r.token_size)].append(r.token_s)
    out: list[calibration.Measurement] = []
    for (tp, p, b), v in sorted(prefill.items()):
        out.append(_measurement(kind, tp, p, b, 0, Phase.PREFILL, statistics.median(v)))
    for (tp, p, b, t), v in sorted(decode.items()):
        out.append(_measurement(kind, tp, p, b, t, Phase.DECODE, statistics.median(v)))
    return out


def _measurement(
    kind: GpuKind, tp: int, p: int, b: int, t: int, phase: Phase, seconds: float
) -> calibration.Measurement:
    return _KindMeasurement(
        kind,
        hardware=kind.name,
        tp=tp,
        prompt_size=p,
        batch_size=b,
        token_size=t,
        phase=phase,
        seconds=seconds,
    )


Fitter = Callable[[Sequence[calibration.Measurement], ModelArch, GpuKind, Dtype], KindFactors]


def fit_kind(
    data: Sequence[calibration.Measurement],
    arch: ModelArch,
    kind: GpuKind,
    dtype: Dtype = Dtype.BF16,
) -> KindFactors:
    """The performance model's own fit (``core.calibration``) on one kind's measurements."""
    return calibration.fit_group(kind.name, (kind.name,), data, arch, dtype)[kind.name]


def fit_errors(
    factors: KindFactors,
    data: Sequence[calibration.Measurement],
    arch: ModelArch,
    kind: GpuKind,
    dtype: Dtype = Dtype.BF16,
) -> tuple[float, tuple[PhaseError, ...]]:
    """In-sample error of the fitted factors: overall median |%|, and per phase."""
    model = PerfModel(EfficiencyFactors(per_kind={kind.name: factors}))
    signed: dict[str, list[float]] = defaultdict(list)
    for m in data:
        pct = (calibration.predict(model, arch, m, dtype) / m.seconds - 1) * 100
        signed[m.phase.value].append(pct)
    phases = tuple(
        PhaseError(
            phase,
            len(v),
            statistics.median(abs(e) for e in v),
            float(np.percentile([abs(e) for e in v], 90)),
            statistics.median(v),
        )
        for phase, v in sorted(signed.items())
    )
    overall = statistics.median(abs(e) for v in signed.values() for e in v)
    return overall, phases


@dataclass
class Calibrations:
    """The daemon's calibrations, loaded from the store at start, one upload at a time."""

    store: CalibrationStore
    catalogue: GpuCatalogue
    archs: Mapping[str, ModelArch]
    clock: Callable[[], float]
    fitter: Fitter = fit_kind
    _by_key: dict[CalibrationKey, Calibration] = field(default_factory=dict, init=False)
    _listeners: list[Callable[[Mapping[CalibrationKey, KindFactors]], None]] = field(
        default_factory=list, init=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def load(self) -> None:
        """Calibrations of models and kinds still configured; others stay stored, unused."""
        self._by_key = {
            c.key: c
            for c in self.store.all()
            if c.model in self.archs and c.gpu_kind in self.catalogue
        }

    def on_change(self, listener: Callable[[Mapping[CalibrationKey, KindFactors]], None]) -> None:
        self._listeners.append(listener)
        listener(self.factors())

    def factors(self) -> dict[CalibrationKey, KindFactors]:
        return {k: c.factors for k, c in self._by_key.items()}

    def get(self, model: str, gpu_kind: str) -> Calibration | None:
        return self._by_key.get((model, gpu_kind))

    def describe(self, model: str, gpu_kind: str) -> str:
        own = self.get(model, gpu_kind)
        return own.describe() if own else PREDICTED

    def upload(
        self,
        model: str,
        gpu_kind: str,
        profile_csv: str,
        model_config: Mapping[str, object] | None = None,
        profiled_at: float | None = None,
    ) -> Calibration:
        """Fit ``profile_csv`` for (model, gpu_kind), store it, and use it from now on.

        ``model_config`` is the profiled model's ``config.json`` when it is not the configured
        model itself (a smaller sibling, say); the factors fitted on it then carry over. Its
        ``torch_dtype`` sets the bytes per weight and KV value the fit counts (a float32
        profile streams twice a BF16 one's bytes); without a config the model is BF16."""
        arch = self.archs.get(model)
        if arch is None:
            raise NotFound(
                f"model {model!r} is not configured (known: {sorted(self.archs)})", field="model"
            )
        kind = self.catalogue.get(gpu_kind)  # NOT_FOUND naming gpu_kind
        dtype = Dtype.BF16
        if model_config is not None:
            arch = _profiled_arch(model, model_config)
            dtype = _profiled_dtype(model_config)
        rows = parse_profile(profile_csv)
        check_hardware(rows[0].hardware, kind)
        data = measurements(rows, kind)
        try:
            factors = self.fitter(data, arch, kind, dtype)
            median, phases = fit_errors(factors, data, arch, kind, dtype)
        except FleetShiftError as err:
            raise InvalidArgument(
                f"{PROFILE_FIELD}: the fit failed: {err.message}", field=PROFILE_FIELD
            ) from None
        except (ValueError, ArithmeticError) as err:
            raise InvalidArgument(
                f"{PROFILE_FIELD}: the fit failed: {err}", field=PROFILE_FIELD
            ) from None
        if not math.isfinite(median):
            raise InvalidArgument(
                f"{PROFILE_FIELD}: the fit failed (no finite error)", field=PROFILE_FIELD
            )
        now = self.clock()
        cal = Calibration(
            model=model,
            gpu_kind=kind.name,
            factors=factors,
            hardware=rows[0].hardware,
            rows=len(rows),
            median_error_pct=median,
            errors=phases,
            profiled_at=profiled_at if profiled_at is not None else now,
            uploaded_at=now,
        )
        with self._lock:
            self.store.put(cal)  # written before anything uses it
            self._by_key[cal.key] = cal
            current = self.factors()
        for listener in self._listeners:
            listener(current)
        return cal


def _profiled_arch(model: str, raw: Mapping[str, object]) -> ModelArch:
    try:
        return ModelArch.from_hf_config(model, raw)
    except InvalidModelArch as err:
        raise InvalidArgument(
            f"model_config: {err.message}", field=f"model_config.{err.field or ''}".rstrip(".")
        ) from None


def _profiled_dtype(raw: Mapping[str, object]) -> Dtype:
    try:
        return dtype_of_config(raw)
    except InvalidArgument as err:
        raise InvalidArgument(
            f"model_config: {err.message}", field=f"model_config.{err.field}"
        ) from None
