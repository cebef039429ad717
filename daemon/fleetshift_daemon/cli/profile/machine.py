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
    """``cpu-<model name>`` for a CPU worker, whatever GPU it is declared as; a GPU worker's
    product name, or the label the operator asked for (e.g. ``h100-80gb``)."""
    if runs_on_cpu(info):
        label = f"cpu-{slug(worker_cpu_name(info, local))}"
        if requested and requested != label and not requested.startswith("cpu-"):
            raise ValueError(
                f"--hardware {requested!r}: the worker runs on the CPU "
                f"({info.compat_key.gpu_product}); a CPU profile is labelled {label!r}, "
                "never as a GPU kind"
            )
        return requested or label
    return requested or slug(info.compat_key.gpu_product)


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


def _best_seconds(fn: Any, runs: int = 5) -> float:
    fn()  # warm-up: allocation and thread pool start
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(threads: int = 0, matmul_n: int = 1024, copy_mb: int = 256) -> Peaks:
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(matmul_n, matmul_n)
        b = torch.randn(matmul_n, matmul_n)
        mm_s = _best_seconds(lambda: torch.mm(a, b))
        src = torch.empty(copy_mb << 18)  # float32: 4 bytes each
        dst = torch.empty_like(src)
        copy_s = _best_seconds(lambda: dst.copy_(src))
        nbytes = src.numel() * src.element_size()
        return Peaks(
            matmul_tflops=2 * matmul_n**3 / mm_s / 1e12,
            matmul_n=matmul_n,
            copy_gbps=2 * nbytes / copy_s / 1e9,
            copy_bytes=nbytes,
            threads=torch.get_num_threads(),
        )
    finally:
        torch.set_num_threads(previous)


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


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_description(local: bool, peaks: Peaks | None) -> dict[str, Any]:
    return {
        "cpu_model": cpu_model_name(),
        "cpu_cores": os.cpu_count(),
        "memory_gb": round(memory_bytes() / 1e9, 2),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "worker_on_this_host": local,
        "measured_peaks": asdict(peaks) if peaks else None,
    }
