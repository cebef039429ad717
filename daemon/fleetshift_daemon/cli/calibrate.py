"""``fleetshift calibrate`` (upload a profile of a model on a GPU kind) and ``fleetshift models``
(each configured model, per GPU kind: measured, or predicted from hardware figures).

    fleetshift calibrate llama-70b --profile h100.csv[:llama-70b/config.json] --gpu-kind H100-SXM
    fleetshift models
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.table import Table

from fleetshift.v1 import calibration_pb2 as pb
from fleetshift.v1 import calibration_pb2_grpc as pb_grpc
from fleetshift_daemon.cli.tables import fit

# Piped output (logs, scripts) is not a terminal: wide enough that no line is wrapped.
console = Console(width=None if sys.stdout.isatty() else 160)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise SystemExit(f"{what} {path}: {err.strerror}") from None


def _profiled_at(csv_path: Path) -> Timestamp | None:
    """The date ``fleetshift profile`` recorded in the sidecar beside the CSV, if there is one."""
    sidecar = csv_path.with_suffix(".json")
    try:
        when = json.loads(sidecar.read_text()).get("profiled_at")
        stamp = Timestamp()
        stamp.FromDatetime(datetime.fromisoformat(when))
        return stamp
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def upload_request(model: str, profile: str, gpu_kind: str) -> pb.UploadCalibrationRequest:
    csv_part, _, config_part = profile.partition(":")
    csv_path = Path(csv_part)
    request = pb.UploadCalibrationRequest(
        model=model, gpu_kind=gpu_kind, profile_csv=_read(csv_path, "--profile")
    )
    if config_part:
        config = Path(config_part)
        request.model_config_json = _read(
            config / "config.json" if config.is_dir() else config, "config"
        )
    stamp = _profiled_at(csv_path)
    if stamp is not None:
        request.profiled_at.CopyFrom(stamp)
    return request


def cmd_calibrate(args: argparse.Namespace, channel: Any) -> int:
    request = upload_request(args.model, args.profile, args.gpu_kind)
    cal = pb_grpc.CalibrationStub(channel).UploadCalibration(
        request, timeout=max(args.timeout, 120)
    )
    console.print(f"{cal.model} on {cal.gpu_kind}: {cal.description} (hardware {cal.hardware})")
    table = Table(title="in-sample fit error per phase")
    for col in ("phase", "points", "median |err| %", "p90 |err| %", "median bias %"):
        table.add_column(col, justify="right")
    for e in cal.errors:
        table.add_row(
            e.phase,
            str(e.points),
            f"{e.median_abs_pct:.1f}",
            f"{e.p90_abs_pct:.1f}",
            f"{e.median_bias_pct:+.1f}",
        )
    console.print(fit(table, console.width))
    return 0


def models_table(reply: pb.ListModelsResponse) -> Table:
    table = Table(title="models: what each GPU kind's predictions rest on")
    for col in ("model", "tp options", "GPU kind"):
        table.add_column(col)
    table.add_column("predictions")
    for model in reply.models:
        for i, kind in enumerate(model.kinds):
            table.add_row(
                model.name if i == 0 else "",
                ",".join(map(str, model.tp_options)) if i == 0 else "",
                kind.basis.gpu_kind,
                f"[green]{kind.basis.description}[/]"
                if kind.basis.measured
                else kind.basis.description,
            )
    return table


def cmd_models(args: argparse.Namespace, channel: Any) -> int:
    reply = pb_grpc.CalibrationStub(channel).ListModels(
        pb.ListModelsRequest(), timeout=args.timeout
    )
    console.print(fit(models_table(reply), console.width))
    return 0


def bases_text(bases: Any) -> str:
    """One line per (model, GPU kind) a report predicted for: measured, or from hardware."""
    return "\n".join(f"  {b.model} on {b.gpu_kind}: {b.description}" for b in bases)


def register(sub: Any, open_channel: Any) -> None:
    """Add ``calibrate`` and ``models`` to the ``fleetshift`` parser."""

    def connected(command: Any) -> Any:
        def run(args: argparse.Namespace) -> int:
            with open_channel(args) as channel:
                return int(command(args, channel))

        return run

    cal = sub.add_parser(
        "calibrate", help="fit a model's profile on a GPU kind and use it for its predictions"
    )
    cal.add_argument("model", help="a configured model")
    cal.add_argument(
        "--profile",
        required=True,
        help="CSV of the reference table's shape (fleetshift profile writes one), optionally "
        ":config.json of the profiled model when it is not the configured one",
    )
    cal.add_argument("--gpu-kind", required=True, help="the catalogue kind it was measured on")
    cal.set_defaults(run=connected(cmd_calibrate))
    models = sub.add_parser(
        "models", help="configured models; per GPU kind, measured or predicted from hardware"
    )
    models.set_defaults(run=connected(cmd_models))
