"""``fleetshift profile`` against a real worker process of the tiny model, and its pure parts
(the sweep's bounds, the knee) on curves whose answer is known."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetshift_daemon.cli.profile.grid import Point, WorkerLimits, geometric, plan_grid
from fleetshift_daemon.cli.profile.knee import CurvePoint, find_knee
from fleetshift_daemon.cli.profile.measure import PointFailed, timing_from_arrivals
from fleetshift_daemon.cli.profile.output import COLUMNS

from .workers import WorkerProcess, Workers, workers_in

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    yield from workers_in(tmp_path)


def profile(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fleetshift_daemon.cli.main", "profile", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)


def test_profile_of_a_real_worker_writes_the_reference_tables_shape(
    tiny_model: Path, workers: Workers, tmp_path: Path
) -> None:
    worker: WorkerProcess = workers.start(
        "--model-dir", str(tiny_model), "--max-running", "4", "--num-blocks", "64"
    )
    out = tmp_path / "prof" / "tiny.csv"
    done = profile(
        "--worker", worker.address, "--config", str(tiny_model), "--out", str(out),
        "--prompt-sizes", "16,64,1024", "--max-concurrency", "16", "--token-size", "12",
        "--repeats", "2", "--threads", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with out.open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        rows = list(reader)
    # 1024 + 12 tokens exceed the tiny model's 512 positions; the worker runs 4 sessions.
    grid = {(int(r["prompt_size"]), int(r["batch_size"])) for r in rows}
    assert grid == {(16, 1), (16, 4), (64, 1), (64, 4)}
    assert len(rows) == 2 * len(grid)
    for r in rows:
        assert r["hardware"].startswith("cpu-"), r["hardware"]
        assert r["model"] == tiny_model.name and r["tensor_parallel"] == "1"
        prompt_ms, token_ms, e2e_ms = (
            float(r[k]) for k in ("prompt_time", "token_time", "e2e_time")
        )
        assert 0 < prompt_ms < e2e_ms and 0 < token_ms < e2e_ms
        assert int(r["token_size"]) >= 12
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["hardware_is_cpu"] is True
    assert sidecar["host"]["cpu_cores"] >= 1 and sidecar["host"]["torch_version"]
    peaks = sidecar["host"]["measured_peaks"]
    assert peaks["matmul_tflops"] > 0 and peaks["copy_gbps"] > 0
    assert sidecar["worker"]["engine"].startswith("fleetshift-ref")
    assert sidecar["model_config"]["num_hidden_layers"] == 2
    assert any("512 positions" in why for why in sidecar["sweep"]["left_out"])
    assert any("at most 4 sessions" in why for why in sidecar["sweep"]["left_out"])
    assert {k["prompt_size"] for k in sidecar["knees"]} == {16, 64}
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_gpu_kind_label_for_a_cpu_worker_is_refused(
    tiny_model: Path, workers: Workers, tmp_path: Path
) -> None:
    worker = workers.start(
        "--model-dir", str(tiny_model), "--declared-gpu", "NVIDIA H100 80GB HBM3"
    )
    out = tmp_path / "p.csv"
    done = profile(
        "--worker", worker.address, "--config", str(tiny_model), "--out", str(out),
        "--hardware", "h100-80gb", "--prompt-sizes", "16", "--max-concurrency", "1",
    )  # fmt: skip
    assert done.returncode == 2
    said = " ".join(done.stderr.split())  # rich wraps lines at the terminal's width
    assert "runs on the CPU" in said and "never as a GPU kind" in said
    assert not out.exists()


def test_the_concurrency_ladder_is_geometric_and_ends_at_the_limit() -> None:
    assert geometric(256) == (1, 4, 16, 64, 256)
    assert geometric(40) == (1, 4, 16, 40)
    assert geometric(1) == (1,)


def test_the_grid_keeps_what_fits_and_names_what_it_left_out() -> None:
    limits = WorkerLimits(kv_tokens=4096, kv_block_size=16, max_running=64, max_context=2048)
    grid = plan_grid(limits, [128, 1024, 4096], max_concurrency=256, token_size=32)
    assert [(p.prompt_size, p.batch_size) for p in grid.points] == [
        (128, 1), (128, 4), (128, 16), (1024, 1),
    ]  # fmt: skip
    text = "\n".join(grid.skipped)
    assert "at most 64 sessions" in text
    assert "prompt 128 x batch 64" in text and "KV blocks" in text
    assert "prompt 4096" in text and "2048 positions" in text


def test_the_knee_is_where_throughput_flattens_and_latency_climbs() -> None:
    # A worker that batches for free up to 16 sessions, then only queues: step 10 ms flat,
    # then growing with the batch.
    curve = [
        CurvePoint(c, c / step, step)
        for c, step in ((1, 0.010), (4, 0.010), (16, 0.011), (64, 0.044), (256, 0.176))
    ]
    knee = find_knee(curve)
    assert knee.concurrency == 16 and knee.saturated
    rising = [CurvePoint(c, c / 0.01, 0.01) for c in (1, 4, 16)]
    assert find_knee(rising).concurrency == 16 and not find_knee(rising).saturated


def test_decode_is_timed_only_while_the_whole_batch_decodes() -> None:
    point = Point(prompt_size=8, batch_size=2, token_size=6)
    # Session a prefills at 1.0 and decodes every 0.1 s; b's prefill lands at 1.3 (a staggered
    # prefill step of 0.3 s in between), then both decode every 0.1 s until a ends at 1.5.
    a = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    b = [1.3, 1.4, 1.5, 1.6, 1.7, 1.8]
    t = timing_from_arrivals(point, sent=0.5, arrivals=[a, b])
    assert t.prompt_s == pytest.approx(0.8)
    assert t.token_s == pytest.approx(0.1)
    assert t.e2e_s == pytest.approx(1.3)
    assert t.decode_steps_timed == 2 and t.stagger_steps == 3
    with pytest.raises(PointFailed, match="after 3 of 6 tokens"):
        timing_from_arrivals(point, 0.0, [a, b[:3]])
