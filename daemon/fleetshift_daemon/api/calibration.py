"""Servicer of the Calibration service: upload a profile per (model, GPU kind), list models.

Thin: check the message's shape, call ``Calibrations.upload`` (one use case), convert back. The
fit takes seconds of CPU, so it runs off the event loop.
"""

from __future__ import annotations

import asyncio
import json

import grpc

from fleetshift.v1 import calibration_pb2 as pb
from fleetshift.v1 import calibration_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2
from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.api import convert
from fleetshift_daemon.core.model_calibrations import Calibration, Calibrations
from fleetshift_daemon.core.placement import PlacementService, PredictionBasis
from fleetshift_rpc.errors import rpc_errors
from fleetshift_rpc.server import ServiceBinding

MAX_PROFILE_BYTES = 16 << 20


def basis_pb(basis: PredictionBasis) -> placement_pb2.PredictionBasis:
    return placement_pb2.PredictionBasis(
        model=basis.model,
        gpu_kind=basis.gpu_kind,
        measured=basis.measured,
        description=basis.description,
    )


def calibration_pb(cal: Calibration) -> pb.ModelCalibration:
    return pb.ModelCalibration(
        model=cal.model,
        gpu_kind=cal.gpu_kind,
        hardware=cal.hardware,
        rows=cal.rows,
        median_error_pct=cal.median_error_pct,
        errors=[
            pb.PhaseFitError(
                phase=e.phase,
                points=e.points,
                median_abs_pct=e.median_abs_pct,
                p90_abs_pct=e.p90_abs_pct,
                median_bias_pct=e.median_bias_pct,
            )
            for e in cal.errors
        ],
        profiled_at=convert.timestamp(cal.profiled_at),
        uploaded_at=convert.timestamp(cal.uploaded_at),
        factors=cal.factors.to_dict(),
        description=cal.describe(),
    )


def _model_config(text: str) -> dict[str, object] | None:
    if not text:
        return None
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise InvalidArgument(
            f"model_config_json is not JSON: {err}", field="model_config_json"
        ) from None
    if not isinstance(raw, dict):
        raise InvalidArgument("model_config_json must be a JSON object", field="model_config_json")
    return raw


class CalibrationServicer(pb_grpc.CalibrationServicer):
    def __init__(self, calibrations: Calibrations, placement: PlacementService) -> None:
        self._calibrations = calibrations
        self._placement = placement

    @rpc_errors
    async def UploadCalibration(
        self, request: pb.UploadCalibrationRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelCalibration:
        for name in ("model", "gpu_kind", "profile_csv"):
            if not getattr(request, name):
                raise InvalidArgument(f"{name} must not be empty", field=name)
        if len(request.profile_csv) > MAX_PROFILE_BYTES:
            raise InvalidArgument(
                f"profile_csv is over {MAX_PROFILE_BYTES >> 20} MiB", field="profile_csv"
            )
        config = _model_config(request.model_config_json)
        profiled_at = (
            request.profiled_at.ToNanoseconds() / 1e9 if request.HasField("profiled_at") else None
        )
        cal = await asyncio.to_thread(
            self._calibrations.upload,
            request.model,
            request.gpu_kind,
            request.profile_csv,
            config,
            profiled_at,
        )
        return calibration_pb(cal)

    @rpc_errors
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        out = pb.ListModelsResponse()
        kinds = [k.name for k in self._calibrations.catalogue.kinds()]
        for name, served in sorted(self._placement.models.items()):
            info = out.models.add(name=name, tp_options=served.tp_options)
            for kind in kinds:
                cal = self._calibrations.get(name, kind)
                entry = info.kinds.add(
                    basis=basis_pb(
                        PredictionBasis(
                            name, kind, cal is not None, self._calibrations.describe(name, kind)
                        )
                    )
                )
                if cal is not None:
                    entry.calibration.CopyFrom(calibration_pb(cal))
        return out


def bindings(calibrations: Calibrations, placement: PlacementService) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            pb_grpc.add_CalibrationServicer_to_server,
            CalibrationServicer(calibrations, placement),
            pb.DESCRIPTOR.services_by_name["Calibration"].full_name,
        )
    ]
