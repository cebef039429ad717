"""SQL store of per-(model, GPU kind) calibrations: one row per pair, replaced by an upload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from sqlalchemy import Engine, select
from sqlalchemy.orm import sessionmaker

from fleetshift_daemon.core.model_calibrations import Calibration, PhaseError
from fleetshift_daemon.core.perf_factors import KindFactors
from fleetshift_daemon.store.models import ModelCalibrationRow
from fleetshift_daemon.store.registry_store import _to_dt, _to_ts


class SqlCalibrationStore:
    def __init__(self, engine: Engine) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    def all(self) -> Sequence[Calibration]:
        with self._sessions() as session:
            rows = session.scalars(select(ModelCalibrationRow))
            return [_calibration(row) for row in rows]

    def put(self, calibration: Calibration) -> None:
        with self._sessions.begin() as session:
            session.merge(
                ModelCalibrationRow(
                    model=calibration.model,
                    gpu_kind=calibration.gpu_kind,
                    factors=calibration.factors.to_dict(),
                    hardware=calibration.hardware,
                    rows=calibration.rows,
                    median_error_pct=calibration.median_error_pct,
                    errors=[asdict(e) for e in calibration.errors],
                    profiled_at=_to_dt(calibration.profiled_at),
                    uploaded_at=_to_dt(calibration.uploaded_at),
                )
            )


def _calibration(row: ModelCalibrationRow) -> Calibration:
    return Calibration(
        model=row.model,
        gpu_kind=row.gpu_kind,
        factors=KindFactors.from_mapping(row.factors, f"model_calibrations[{row.model}]"),
        hardware=row.hardware,
        rows=row.rows,
        median_error_pct=row.median_error_pct,
        errors=tuple(PhaseError(**e) for e in row.errors),
        profiled_at=_to_ts(row.profiled_at) or 0.0,
        uploaded_at=_to_ts(row.uploaded_at) or 0.0,
    )
