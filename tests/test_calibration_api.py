"""Calibrations per (model, GPU kind) through the real daemon: ``fleetshift calibrate`` uploads
a profile, the daemon fits and stores it (SQLite and PostgreSQL), ``fleetshift models`` shows
it measured after a restart, bad uploads change nothing, and the predictions the router and
planner make for that pair change while every other pair says it is predicted."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import calibration_pb2 as cpb
from fleetshift.v1 import calibration_pb2_grpc as cpb_grpc
from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.app import Daemon

from .clock import ManualClock
from .conftest import REPO, SHARED

GiB = 1024**3
MODEL = "llama-70b"
PREDICTED = "predicted from hardware figures, not measured"
REFERENCE = SHARED / "reference" / "splitwise_perf_llama2_70b.csv"


def profile_text(source: str = "h100-80gb", slower: float = 1.0, **override: str) -> str:
    """The reference table's rows of one hardware kind, as a profile of MODEL (times scaled by
    ``slower``: a serving stack that slow)."""
    with REFERENCE.open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["hardware"] == source]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    for r in rows:
        for col in ("prompt_time", "token_time", "e2e_time"):
            r[col] = str(float(r[col]) * slower)
        writer.writerow({**r, "model": MODEL, **override})
    return out.getvalue()


def daemon_config(tmp_path: Path, url: str) -> DaemonConfig:
    return DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=30.0,
        liveness_check_interval_s=0.2,
        models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4, 8)),),
        planner=PlannerSettings(interval_s=0.3, threshold=0.95, hold_s=0.0, horizon_s=3600),
    )


async def cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """The operator's command line, as its own process (the daemon serves meanwhile)."""
    cmd = [sys.executable, "-m", "fleetshift_daemon.cli.main", "--daemon",
           f"127.0.0.1:{daemon.port}", *args]  # fmt: skip
    return await asyncio.to_thread(
        subprocess.run, cmd, cwd=REPO, capture_output=True, text=True, timeout=120
    )


async def list_models(daemon: Daemon) -> cpb.ListModelsResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        return await cpb_grpc.CalibrationStub(ch).ListModels(cpb.ListModelsRequest())


def by_kind(reply: cpb.ListModelsResponse) -> dict[str, cpb.ModelKind]:
    [model] = reply.models
    assert model.name == MODEL
    return {k.basis.gpu_kind: k for k in model.kinds}


async def test_an_uploaded_profile_is_shown_measured_and_survives_a_restart(
    tmp_path: Path, db_url: str
) -> None:
    csv_path = tmp_path / "h100.csv"
    csv_path.write_text(profile_text())
    csv_path.with_suffix(".json").write_text(
        json.dumps({"profiled_at": "2026-11-30T10:00:00+00:00"})
    )
    daemon = Daemon(daemon_config(tmp_path, db_url))
    await daemon.start()
    try:
        before = await cli(daemon, "models")
        assert before.returncode == 0, before.stderr
        assert " ".join(before.stdout.split()).count(PREDICTED) == 4  # A100, H100, H200, L40S
        done = await cli(
            daemon, "calibrate", MODEL, "--profile", str(csv_path), "--gpu-kind", "H100-SXM"
        )
        assert done.returncode == 0, done.stderr + done.stdout
        said = " ".join(done.stdout.split())
        assert "measured (profile of 2026-11-30, 315 rows, median error" in said
        shown = (await cli(daemon, "models")).stdout
        [h100_line] = [line for line in shown.splitlines() if "H100-SXM" in line]
        assert "measured (profile of 2026-11-30, 315 rows, median error" in h100_line
        assert shown.count(PREDICTED) == 3
        first = by_kind(await list_models(daemon))["H100-SXM"]
    finally:
        await daemon.stop(0.1)

    again = Daemon(daemon_config(tmp_path, db_url))
    await again.start()
    try:
        kinds = by_kind(await list_models(again))
        h100 = kinds["H100-SXM"]
        assert h100.basis.measured and h100.calibration.rows == 315
        assert h100.calibration.hardware == "h100-80gb"
        assert dict(h100.calibration.factors) == pytest.approx(dict(first.calibration.factors))
        assert {e.phase for e in h100.calibration.errors} == {"prefill", "decode"}
        assert 0 < h100.calibration.median_error_pct < 10
        assert not kinds["H200-SXM"].basis.measured
        assert kinds["H200-SXM"].basis.description == PREDICTED
    finally:
        await again.stop(0.1)


BAD_UPLOADS = [
    ({"model": "nope"}, grpc.StatusCode.NOT_FOUND, "model 'nope' is not configured"),
    ({"gpu_kind": "B200"}, grpc.StatusCode.NOT_FOUND, "gpu kind 'B200'"),
    ({"profile_csv": "model,hardware\nx,y\n"}, grpc.StatusCode.INVALID_ARGUMENT, "lacks column"),
    (
        {"profile_csv": profile_text(prompt_time="fast")},
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_time 'fast' is not a number",
    ),
    (
        {"profile_csv": profile_text(source="a100-80gb")},
        grpc.StatusCode.INVALID_ARGUMENT,
        "is A100-SXM-80GB, not gpu_kind 'H100-SXM'",
    ),
    (
        {"profile_csv": profile_text(hardware="cpu-amd-epyc")},
        grpc.StatusCode.INVALID_ARGUMENT,
        "measured on a CPU; it cannot calibrate GPU kind",
    ),
    (  # TP 3 does not divide the model's 64 heads: nothing to fit
        {"profile_csv": profile_text(tensor_parallel="3")},
        grpc.StatusCode.INVALID_ARGUMENT,
        "the fit failed",
    ),
    ({"model_config_json": "[1]"}, grpc.StatusCode.INVALID_ARGUMENT, "model_config_json"),
]


@pytest.fixture
async def sqlite_daemon(tmp_path: Path, sqlite_url: str) -> AsyncIterator[Daemon]:
    daemon = Daemon(daemon_config(tmp_path, sqlite_url))
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop(0.1)


@pytest.mark.parametrize(("change", "code", "named"), BAD_UPLOADS)
async def test_a_bad_upload_is_refused_by_field_and_changes_nothing(
    sqlite_daemon: Daemon, change: dict[str, str], code: grpc.StatusCode, named: str
) -> None:
    request = cpb.UploadCalibrationRequest(
        model=MODEL, gpu_kind="H100-SXM", profile_csv=profile_text()
    )
    for key, value in change.items():
        setattr(request, key, value)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sqlite_daemon.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cpb_grpc.CalibrationStub(ch).UploadCalibration(request)
    assert err.value.code() == code
    assert named in (err.value.details() or "")
    assert all(not k.basis.measured for k in by_kind(await list_models(sqlite_daemon)).values())
    assert sqlite_daemon.calibrations is not None
    assert list(sqlite_daemon.calibrations.store.all()) == []


NODES = {"h100-1": "NVIDIA H100 80GB HBM3", "h200-1": "NVIDIA H200"}
WORKERS = {
    "h100-1": ("dec-h100", fpb.WORKER_ROLE_DECODE),
    "h200-1": ("pre-h200", fpb.WORKER_ROLE_PREFILL),
}


async def register_fleet(ch: grpc.aio.Channel) -> None:
    """Declared nodes and the workers their agents report: decode on H100, prefill on H200."""
    agents = fpb_grpc.AgentRegistryStub(ch)
    for node, product in NODES.items():
        gpus = [fpb.Gpu(index=i, product_name=product, memory_bytes=80 * GiB) for i in range(8)]
        await agents.RegisterNode(
            fpb.RegisterNodeRequest(
                node_name=node,
                agent_address="127.0.0.1:1",
                gpus=gpus,
                inventory_source=fpb.INVENTORY_SOURCE_DECLARED,
            )
        )
        wid, role = WORKERS[node]
        status = fpb.WorkerStatus(
            worker_id=wid, model=MODEL, role=role, tensor_parallel=4, dtype="bf16",
            gpu_indices=[0, 1, 2, 3], endpoint=f"127.0.0.1:{9000 + len(wid)}",
            state=fpb.WORKER_STATE_SERVING,
            counters=fpb.WorkerCounters(worker_id=wid, kv_blocks_total=100_000),
        )  # fmt: skip
        await agents.Heartbeat(fpb.HeartbeatRequest(node_name=node, workers=[status]))


def bases(report: pb.Plan | pb.EfficiencyReport) -> dict[str, tuple[bool, str]]:
    return {b.gpu_kind: (b.measured, b.description) for b in report.predictions if b.model == MODEL}


async def test_predictions_for_the_pair_change_after_an_upload(
    tmp_path: Path, sqlite_url: str
) -> None:
    clock = ManualClock(time.time())
    daemon = Daemon(daemon_config(tmp_path, sqlite_url), clock=clock)
    await daemon.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            await register_fleet(ch)
            placement, planning = pb_grpc.PlacementStub(ch), pb_grpc.PlanningStub(ch)
            route = pb.RouteRequest(model=MODEL, prompt_tokens=128, expected_output_tokens=1500)
            before = await placement.Route(route)
            assert before.decode_worker_id == "dec-h100"
            plan = await planning.PlanRebalance(pb.PlanRebalanceRequest())
            assert bases(plan) == {"H100-SXM": (False, PREDICTED), "H200-SXM": (False, PREDICTED)}

            # A serving stack twice as slow as the reference on H100, measured.
            await cpb_grpc.CalibrationStub(ch).UploadCalibration(
                cpb.UploadCalibrationRequest(
                    model=MODEL, gpu_kind="H100-SXM", profile_csv=profile_text(slower=2.0)
                )
            )
            after = await placement.Route(route)
            assert after.decode_worker_id == "dec-h100"
            # The H100 decode step is predicted from the slow profile now; H200 is untouched.
            assert after.terms.predicted_tbt_ms > 1.6 * before.terms.predicted_tbt_ms
            plan = await planning.PlanRebalance(pb.PlanRebalanceRequest())
            measured, text = bases(plan)["H100-SXM"]
            assert measured and text.startswith("measured (profile of ") and "315 rows" in text
            assert bases(plan)["H200-SXM"] == (False, PREDICTED)
            report = await planning.GetEfficiency(pb.GetEfficiencyRequest(history=1))
            assert bases(report) == bases(plan)
    finally:
        await daemon.stop(0.1)
