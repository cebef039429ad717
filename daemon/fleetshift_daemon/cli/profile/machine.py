"""What a profile ran on: the worker's platform as it reports it, and this host's measured peaks.

For a CPU to stand in as a "hardware kind" the performance model needs its peak compute and
memory bandwidth. A CPU has no datasheet figure the model could trust (turbo, SMT, the threads
torch uses), so they are measured here, with the same library the reference engine computes
with: a timed float32 matrix product and a timed memory copy, best of several runs. They are
measured on the profiler's own host, so they describe the worker only when it runs on this
host (a loopback address); otherwise the sidecar says they were not measured.
"""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fleetshift.v1 import worker_pb2
from fleetshift_daemon.cli.profile.measure import HostSpeed
from fleetshift_daemon.core.gpus import default_catalogue

DECLARED = " (declared)"


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def runs_on_cpu(info: worker_pb2.WorkerInfo) -> bool:
    """A CPU worker says so in its compatibility key, also when it stands in for a GPU."""
    key = info.compat_key
    return (
        key.compute_capability in ("", "none")
        or key.gpu_product.startswith("cpu:")
        or key.gpu_product.endswith(DECLARED)
    )


def worker_cpu_name(info: worker_pb2.WorkerInfo, local: bool) -> str:
    product = info.compat_key.gpu_product
    if product.startswith("cpu:"):
        return product.removeprefix("cpu:").strip()
    return cpu_model_name() if local else "unknown"


def hardware_label(info: worker_pb2.WorkerInfo, local: bool, requested: str) -> str:
    """``cpu-<model name>`` for a CPU worker, whatever GPU it is declared as; for a GPU
    worker, the label the operator asked for (e.g. ``h100-80gb``), else the catalogue kind
    its product name matches (``NVIDIA H200`` -> ``H200-SXM``), the name ``fleetshift
    calibration`` reads back, else the product name itself (a GPU the catalogue lacks: the
    calibration refuses it by name until the operator passes ``--hardware``)."""
    if runs_on_cpu(info):
        label = f"cpu-{slug(worker_cpu_name(info, local))}"
        if requested and requested != label and not requested.startswith("cpu-"):
            raise ValueError(
                f"--hardware {requested!r}: the worker runs on the CPU "
                f"({info.compat_key.gpu_product}); a CPU profile is labelled {label!r}, "
                "never as a GPU kind"
            )
        return requested or label
    if requested:
        return requested
    kind = default_catalogue().for_product(info.compat_key.gpu_product)
    return kind.name if kind is not None else slug(info.compat_key.gpu_product)


@dataclass(frozen=True)
class Peaks:
    matmul_tflops: float  # float32 dense, best of the runs
    matmul_n: int
    copy_gbps: float  # bytes read + written per second, best of the runs
    copy_bytes: int
    threads: int
    note: str = (
        "measured on the profiler's host with torch: a timed float32 n x n matrix product "
        "(2 n^3 FLOPs) and a timed copy of copy_bytes (read + write counted), best of 5"
    )
    # The per-run probe (``HostProbe``) timed right after the peaks: the rows' host_* columns
    # divided by these are the host's speed at that row relative to these peaks (0: no probe).
    probe_matmul_gflops: float = 0.0
    probe_copy_gbps: float = 0.0
    # The same matmul and copy per second of this process's CPU time, not of wall time: the
    # core's own rate while it runs them, whatever share of it other processes take. A run's
    # ``worker_cpu_share`` times these is the rate the worker had over that run (0: not timed).
    cpu_matmul_tflops: float = 0.0
    cpu_copy_gbps: float = 0.0


def _best_seconds(fn: Any, runs: int = 5, clock: Any = time.perf_counter) -> float:
    fn()  # warm-up: allocation and thread pool start
    best = float("inf")
    for _ in range(runs):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _cpu_clock() -> Any:
    """The CPU clock that counts only the timed work. With one torch thread the work runs on
    the calling thread, so that thread's CPU time: the process's would also count the
    profiler's other threads (gRPC polling, the progress bar), which run beside it on another
    core and made the rate per CPU second read below the wall-clock one. With a thread pool
    the work spans threads, so the process's CPU time, noise included."""
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


def measure_peaks(threads: int = 0, matmul_n: int = 1024, copy_mb: int = 256) -> Peaks:
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(matmul_n, matmul_n)
        b = torch.randn(matmul_n, matmul_n)
        cpu_clock = _cpu_clock()
        mm_s = _best_seconds(lambda: torch.mm(a, b))
        mm_cpu_s = _best_seconds(lambda: torch.mm(a, b), clock=cpu_clock)
        src = torch.empty(copy_mb << 18)  # float32: 4 bytes each
        dst = torch.empty_like(src)
        copy_s = _best_seconds(lambda: dst.copy_(src))
        copy_cpu_s = _best_seconds(lambda: dst.copy_(src), clock=cpu_clock)
        nbytes = src.numel() * src.element_size()
        return Peaks(
            matmul_tflops=2 * matmul_n**3 / mm_s / 1e12,
            matmul_n=matmul_n,
            copy_gbps=2 * nbytes / copy_s / 1e9,
            copy_bytes=nbytes,
            threads=torch.get_num_threads(),
            cpu_matmul_tflops=2 * matmul_n**3 / max(mm_cpu_s, 1e-6) / 1e12,
            cpu_copy_gbps=2 * nbytes / max(copy_cpu_s, 1e-6) / 1e9,
        )
    finally:
        torch.set_num_threads(previous)


class HostProbe:
    """A short reference matmul and copy, timed beside every run of a sweep (~50 ms on an idle
    core: a few percent of a run). Mean rates, not best: under load the probe gets the share
    of the core the worker got, which is what the run's time reflects. Tensors are allocated
    once; the copy is larger than a last-level cache so it measures memory, not cache."""

    def __init__(
        self, threads: int = 0, matmul_n: int = 512, matmul_runs: int = 4, copy_mb: int = 64
    ) -> None:
        self._threads = threads
        self._n, self._runs = matmul_n, matmul_runs
        self._a, self._b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
        self._src = torch.empty(copy_mb << 18)  # float32: 4 bytes each
        self._dst = torch.empty_like(self._src)

    def __call__(self) -> HostSpeed:
        previous = torch.get_num_threads()
        if self._threads:
            torch.set_num_threads(self._threads)
        try:
            torch.mm(self._a, self._b)  # warm: the thread pool may have been idle for seconds
            t0 = time.perf_counter()
            for _ in range(self._runs):
                torch.mm(self._a, self._b)
            mm_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(2):
                self._dst.copy_(self._src)
            copy_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads(previous)
        nbytes = self._src.numel() * self._src.element_size()
        return HostSpeed(
            matmul_gflops=2 * self._n**3 * self._runs / mm_s / 1e9,
            copy_gbps=2 * 2 * nbytes / copy_s / 1e9,
        )


def listening_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process of this user listening on TCP ``port`` (the local worker), from the kernel's
    socket tables; None where none is found (another user's process, or not listening here)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for entry in proc.glob("[0-9]*") if inodes else ():
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    return None


def process_cpu_s(pid: int, proc: Path = Path("/proc")) -> float:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far."""
    fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mean_speed(before: HostSpeed, after: HostSpeed) -> HostSpeed:
    """A run's host speed: the mean of the probes just before and just after it."""
    return HostSpeed(
        (before.matmul_gflops + after.matmul_gflops) / 2, (before.copy_gbps + after.copy_gbps) / 2
    )


def worker_description(info: worker_pb2.WorkerInfo) -> dict[str, Any]:
    key = info.compat_key
    return {
        "worker_id": info.worker_id,
        "model_id": info.model_id,
        "engine": f"{key.engine_name} {key.engine_version}",
        "torch_version": key.torch_version,
        "gpu_product": key.gpu_product,
        "compute_capability": key.compute_capability,
        "dtype": key.dtype,
        "tensor_parallel": key.tensor_parallel or 1,
        "kv_block_size": info.kv_block_size,
        "kv_blocks_total": info.kv_blocks_total,
        "max_running": info.max_running,
        "compiled": info.compiled,
    }


_CPU0 = Path("/sys/devices/system/cpu/cpu0")
_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def core_cache_mb(cpu: Path = _CPU0) -> float:
    """The largest data cache private to one core (shared only with its own SMT threads), MiB,
    as the kernel reports it; 0.0 where it does not. The performance model takes weights larger
    than this to be read from memory again by every chunk of rows the reference engine
    multiplies: a shared last-level cache is also the other processes' and tenants', so what
    of it the worker keeps is not known."""
    try:
        core = (cpu / "topology" / "thread_siblings_list").read_text().strip()
        best = 0
        for index in sorted((cpu / "cache").glob("index*")):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            if (index / "shared_cpu_list").read_text().strip() != core:
                continue
            size = (index / "size").read_text().strip()
            value = int(size.rstrip("KMG")) * _SIZE_UNITS.get(size[-1:], 1)
            best = max(best, value)
    except (OSError, ValueError):
        return 0.0
    return best / 2**20


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_description(local: bool, peaks: Peaks | None) -> dict[str, Any]:
    return {
        "cpu_model": cpu_model_name(),
        "cpu_cores": os.cpu_count(),
        "memory_gb": round(memory_bytes() / 1e9, 2),
        "core_cache_mb": core_cache_mb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "worker_on_this_host": local,
        "measured_peaks": asdict(peaks) if peaks else None,
    }
