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
from fleetshift_daemon.cli.profile.output import COLUMNS, HOST_COLUMNS, SHARE_COLUMN

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
        # the reference table's columns first and unchanged, then the host's speed per run
        # and the share of a core the worker's process got over it
        assert tuple(reader.fieldnames or ()) == COLUMNS + HOST_COLUMNS + (SHARE_COLUMN,)
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
        assert float(r["host_matmul_gflops"]) > 0 and float(r["host_copy_gbps"]) > 0
        # one compute thread plus the worker's gRPC and Python threads: some of a core, never
        # nothing (it computed) and never far past what two cores give; left empty (unknown)
        # for a run shorter than the kernel's CPU clock tick, which can read no CPU time
        assert r[SHARE_COLUMN] == "" or 0 < float(r[SHARE_COLUMN]) <= 2.05, r[SHARE_COLUMN]
    assert any(r[SHARE_COLUMN] for r in rows)  # longer runs span ticks: their share is known
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["hardware_is_cpu"] is True
    assert sidecar["host"]["cpu_cores"] >= 1 and sidecar["host"]["torch_version"]
    peaks = sidecar["host"]["measured_peaks"]
    assert peaks["matmul_tflops"] > 0 and peaks["copy_gbps"] > 0
    assert peaks["probe_matmul_gflops"] > 0 and peaks["probe_copy_gbps"] > 0
    # per second of CPU time the rate is at least the wall-clock one (a share of the core)
    assert peaks["cpu_matmul_tflops"] >= 0.9 * peaks["matmul_tflops"]
    assert peaks["cpu_copy_gbps"] >= 0.9 * peaks["copy_gbps"]
    assert sidecar["host"]["core_cache_mb"] >= 0
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


def test_a_gpu_worker_is_labelled_with_the_catalogue_kind_calibration_reads() -> None:
    """A GPU worker's product (as CUDA names it) becomes the catalogue kind's name, which the
    calibration's loader maps back onto that kind; a GPU the catalogue lacks keeps its own
    name, and the loader refuses it naming the names it knows."""
    from fleetshift.v1 import worker_pb2
    from fleetshift_common.errors import InvalidArgument
    from fleetshift_daemon.cli.profile.machine import hardware_label
    from fleetshift_daemon.core.gpus import H200_SXM
    from fleetshift_daemon.core.measurements import hardware_kind

    def info(product: str) -> worker_pb2.WorkerInfo:
        key = worker_pb2.WorkerCompatKey(gpu_product=product, compute_capability="9.0")
        return worker_pb2.WorkerInfo(compat_key=key)

    label = hardware_label(info("NVIDIA H200"), local=True, requested="")
    assert label == "H200-SXM"
    assert hardware_kind(label) is H200_SXM
    assert hardware_label(info("NVIDIA H200"), local=True, requested="h200-x") == "h200-x"
    unknown = hardware_label(info("NVIDIA B200"), local=True, requested="")
    assert unknown == "nvidia-b200"
    with pytest.raises(InvalidArgument, match="unknown hardware 'nvidia-b200'"):
        hardware_kind(unknown)


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


def test_the_probed_csv_is_read_back_at_each_runs_host_speed(tmp_path: Path) -> None:
    """What ``fleetshift profile`` writes is what the calibration reads: the reference
    columns first, then each run's probed host speed, which sets that row's CPU kind."""
    from fleetshift_daemon.cli.profile.machine import HostProbe, mean_speed
    from fleetshift_daemon.cli.profile.measure import HostSpeed, Timing
    from fleetshift_daemon.cli.profile.output import ProfileLabel, write_csv
    from fleetshift_daemon.core.measurements import load_measurements

    probed = HostProbe(threads=1)()  # real tensors on this host
    assert probed.matmul_gflops > 0 and probed.copy_gbps > 0
    speed = mean_speed(HostSpeed(40.0, 4.0), HostSpeed(20.0, 2.0))
    assert speed == HostSpeed(30.0, 3.0)
    runs = [
        Timing(Point(16, 1, 8), 0.2, 0.02, 0.4, 7, 0, HostSpeed(60.0, 6.0)),
        Timing(Point(32, 1, 8), 0.4, 0.04, 0.8, 7, 0, speed),
    ]
    out = tmp_path / "p.csv"
    write_csv(out, ProfileLabel("m", "cpu-x", 1), runs)
    with out.open() as fh:
        assert tuple(csv.DictReader(fh).fieldnames or ()) == COLUMNS + HOST_COLUMNS
    peaks = {"matmul_tflops": 0.05, "copy_gbps": 5.0}
    peaks |= {"probe_matmul_gflops": 60.0, "probe_copy_gbps": 6.0}
    out.with_suffix(".json").write_text(json.dumps({"host": {"measured_peaks": peaks}}))
    kinds = {m.prompt_size: m.kind for m in load_measurements(out)}
    assert kinds[16].bf16_tflops == pytest.approx(0.1) and kinds[16].hbm_tbps == 0.005
    assert kinds[32].bf16_tflops == pytest.approx(0.05)  # half the start's speed
    assert kinds[32].hbm_tbps == pytest.approx(0.0025)
    write_csv(out, ProfileLabel("m", "cpu-x", 1), [Timing(Point(16, 1, 8), 0.2, 0.02, 0.4, 7, 0)])
    with out.open() as fh:  # not probed (--no-peaks, a remote worker): the nine columns only
        assert tuple(csv.DictReader(fh).fieldnames or ()) == COLUMNS


def test_the_workers_cpu_share_sets_its_rows_rate_from_the_cores_rate_per_cpu_second(
    tmp_path: Path,
) -> None:
    """A probe between runs samples the host; what a run's time reflects is the share of a
    core the worker got. With the worker's CPU seconds per run written, a row's kind is the
    core's rate per CPU second (the sidecar's ``cpu_*``) times that share."""
    from fleetshift_daemon.cli.profile.measure import HostSpeed, Timing
    from fleetshift_daemon.cli.profile.output import ProfileLabel, write_csv
    from fleetshift_daemon.core.measurements import load_measurements

    runs = [  # 0.1 CPU s over a 0.4 s run: a quarter of a core; then half of one
        Timing(Point(16, 1, 8), 0.2, 0.02, 0.4, 7, 0, HostSpeed(60.0, 6.0), worker_cpu_s=0.1),
        Timing(Point(32, 1, 8), 0.4, 0.04, 0.8, 7, 0, HostSpeed(60.0, 6.0), worker_cpu_s=0.4),
    ]
    out = tmp_path / "p.csv"
    write_csv(out, ProfileLabel("m", "cpu-x", 1), runs)
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r[SHARE_COLUMN]) for r in rows] == [0.25, 0.5]
    peaks = {"matmul_tflops": 0.05, "copy_gbps": 5.0, "probe_matmul_gflops": 60.0}
    peaks |= {"probe_copy_gbps": 6.0, "cpu_matmul_tflops": 0.08, "cpu_copy_gbps": 8.0}
    sidecar = {"host": {"measured_peaks": peaks, "core_cache_mb": 1.0}}
    out.with_suffix(".json").write_text(json.dumps(sidecar))
    kinds = {m.prompt_size: m.kind for m in load_measurements(out)}
    assert kinds[16].bf16_tflops == pytest.approx(2 * 0.08 * 0.25)  # FP32 rate doubled
    assert kinds[16].hbm_tbps == pytest.approx(0.008 * 0.25)
    assert kinds[32].bf16_tflops == pytest.approx(2 * 0.08 * 0.5)
    assert kinds[16].core_cache_mb == 1.0
    # a sidecar without the per-CPU-second rates: the probes scale the peaks, as before
    del peaks["cpu_matmul_tflops"], peaks["cpu_copy_gbps"]
    out.with_suffix(".json").write_text(json.dumps({"host": {"measured_peaks": peaks}}))
    kinds = {m.prompt_size: m.kind for m in load_measurements(out)}
    assert kinds[16].bf16_tflops == pytest.approx(0.1) and kinds[16].core_cache_mb == 0.0


def test_a_run_shorter_than_a_cpu_clock_tick_leaves_its_share_unknown(tmp_path: Path) -> None:
    """The kernel counts CPU time in clock ticks, so a run shorter than one can read none.
    Its share is written empty, not 0 (which calibration refuses as no rate at all), and the
    profile still loads; a CI rehearsal's sweep wrote 0.0000 on such a row."""
    from fleetshift_daemon.cli.profile.measure import HostSpeed, Timing
    from fleetshift_daemon.cli.profile.output import ProfileLabel, write_csv
    from fleetshift_daemon.core.measurements import load_measurements

    runs = [
        Timing(Point(16, 1, 8), 0.002, 0.001, 0.009, 7, 0, HostSpeed(60.0, 6.0), worker_cpu_s=0.0),
        Timing(Point(32, 1, 8), 0.4, 0.04, 0.8, 7, 0, HostSpeed(60.0, 6.0), worker_cpu_s=0.4),
    ]
    out = tmp_path / "p.csv"
    write_csv(out, ProfileLabel("m", "cpu-x", 1), runs)
    with out.open() as fh:
        assert [r[SHARE_COLUMN] for r in csv.DictReader(fh)] == ["", "0.5000"]
    assert {m.prompt_size for m in load_measurements(out)} == {16, 32}


def test_the_local_workers_process_is_found_by_its_port_and_its_cpu_time_read(
    tmp_path: Path,
) -> None:
    """The profiler finds the worker it sweeps by the loopback port it listens on and reads
    its CPU seconds from the kernel: here a real listening socket of a real child process."""
    import socket
    import time

    from fleetshift_daemon.cli.profile.machine import core_cache_mb, listening_pid, process_cpu_s

    busy = (
        "import socket,sys,time\n"
        "s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "end=time.process_time()+0.3\n"
        "while time.process_time()<end: pass\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert listening_pid(port) == child.pid
        deadline = time.monotonic() + 20
        while process_cpu_s(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.3 <= process_cpu_s(child.pid) < 5
    finally:
        child.kill()
        child.wait()
    with socket.socket() as idle:  # bound, not listening: not a worker
        idle.bind(("127.0.0.1", 0))
        assert listening_pid(idle.getsockname()[1]) is None
    # the cache private to a core, from a sysfs tree laid out as the kernel's
    cpu = tmp_path / "cpu0"
    (cpu / "topology").mkdir(parents=True)
    (cpu / "topology" / "thread_siblings_list").write_text("0\n")
    for i, (level, kind, size, shared) in enumerate(
        [(1, "Data", "32K", "0"), (1, "Instruction", "32K", "0"), (2, "Unified", "1024K", "0"),
         (3, "Unified", "32768K", "0-1")]
    ):  # fmt: skip
        d = cpu / "cache" / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(f"{value}\n")
        (d / "shared_cpu_list").write_text(f"{shared}\n")
    assert core_cache_mb(cpu) == 1.0  # L2; the L3 is shared with the other core
    assert core_cache_mb(tmp_path / "nowhere") == 0.0
