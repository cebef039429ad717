"""Measured inference times in the reference table's shape, read strictly.

One CSV row is one run: ``model, hardware, tensor_parallel, prompt_size, batch_size,
token_size, prompt_time, token_time`` (times in ms; other columns are ignored). Repeats of a
configuration are reduced to their median, prefill keyed without ``token_size`` (a prefill
does not depend on how many tokens follow). Every refusal names the file, the line and the
column, because an operator's own profile is what gets fed in here.

Hardware names are the reference table's (``a100-80gb``, ``h100-80gb``, ``h100-80gb-pcap``),
any catalogue kind's own name (``H200-SXM``), or ``cpu``/``cpu-<model>`` for a profile of the
reference engine on a CPU, which is labelled as such and never as a GPU kind. A CPU profile
written by ``fleetshift profile`` has a JSON sidecar beside it (``OUT.json``) with the peaks it
measured on that host; those are the CPU kind's figures, else ``CPU_HOST``'s nominal ones.

A shared host's speed moves under a sweep, so ``fleetshift profile`` also writes, after the
reference columns, the speed of a short reference matmul and copy timed around each run
(``HOST_COLUMNS``). Where a CPU row carries them, its kind's compute and bandwidth peaks are
the sidecar's scaled by the row's probe over the same probe's figure at the start (the
sidecar's ``probe_*``); where not, the sidecar's single figure stands. The columns are
optional, and ignored on GPU rows (the probe times the profiler's CPU, not a GPU).

A probe between runs samples the host, not what the worker got over a run, so a sweep that
found the local worker's process also writes its CPU seconds over each run's wall time
(``SHARE_COLUMN``), and its sidecar the core's rates per CPU second (``cpu_*``); where both
are there, a row's peaks are those rates times the row's share, and the probes are not used.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.gpus import (
    A100_SXM_80GB,
    H100_SXM,
    H100_SXM_PCAP70,
    H200_SXM,
    L40S,
    GpuKind,
)

# The 2-core AMD EPYC (Zen 4) virtual machine the reference engine is profiled on here. Peak:
# 2 cores x 2.6 GHz x 64 BF16 FLOP/cycle (AVX-512 BF16) = 0.33 TFLOPS (FP32: half); memory
# 40 GB/s is a nominal share of the socket's DDR5 for two vCPUs, not a measurement. No link.
CPU_HOST = GpuKind(
    name="CPU",
    product_patterns=(),
    bf16_tflops=0.333,
    fp8_tflops=None,
    int8_tops=0.666,
    hbm_gb=22.0,
    hbm_tbps=0.04,
    nvlink_gbps=0.0,
    tdp_w=1.0,
    price_per_hour=0.0,
    pcie_gbps=10.0,
)
# hardware column -> the kind it was measured on
HARDWARE_KINDS: dict[str, GpuKind] = {
    "a100-80gb": A100_SXM_80GB,
    "h100-80gb": H100_SXM,
    "h100-80gb-pcap": H100_SXM_PCAP70,
    "cpu": CPU_HOST,
}
_BY_KIND_NAME: dict[str, GpuKind] = {
    k.name: k for k in (A100_SXM_80GB, H100_SXM, H100_SXM_PCAP70, H200_SXM, L40S, CPU_HOST)
}
REQUIRED_COLUMNS = (
    "model",
    "hardware",
    "tensor_parallel",
    "prompt_size",
    "batch_size",
    "token_size",
    "prompt_time",
    "token_time",
)


HOST_COLUMNS = ("host_matmul_gflops", "host_copy_gbps")
# The worker process's CPU seconds over the run's wall time: the share of a core it got.
SHARE_COLUMN = "worker_cpu_share"


@dataclass(frozen=True)
class HostSpeed:
    """A run's host speed, as ``HOST_COLUMNS`` and ``SHARE_COLUMN`` record it (None: not in
    the file)."""

    matmul_gflops: float | None = None
    copy_gbps: float | None = None
    cpu_share: float | None = None


UNPROBED = HostSpeed()


def hardware_kind(name: str, where: str = "hardware") -> GpuKind:
    """The kind a hardware name denotes; an unknown one is refused with the names known."""
    kind = HARDWARE_KINDS.get(name) or _BY_KIND_NAME.get(name)
    if kind is None:
        known = sorted(HARDWARE_KINDS) + sorted(_BY_KIND_NAME)
        raise InvalidArgument(
            f"{where}: unknown hardware {name!r} (known: {known})", field="hardware"
        )
    return kind


@dataclass(frozen=True)
class Measurement:
    hardware: str
    tp: int
    prompt_size: int
    batch_size: int
    token_size: int
    phase: Phase
    seconds: float  # median over repeats
    model: str = ""  # the file's model column, as written
    measured_on: GpuKind | None = None  # a kind not in the catalogue (a CPU's measured peaks)

    @property
    def kind(self) -> GpuKind:
        return self.measured_on or hardware_kind(self.hardware)


# bytes per value of a worker's dtype (the sidecar's ``worker.dtype``)
_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cpu_kind(
    hardware: str,
    peaks: Mapping[str, object],
    memory_gb: float,
    dtype: str = "float32",
    core_cache_mb: float = 0.0,
) -> GpuKind:
    """A CPU as a hardware kind: the peaks ``fleetshift profile`` measured on it, never invented.

    ``peaks``: ``matmul_tflops`` (a timed matrix product in the worker's ``dtype``) and
    ``copy_gbps`` (a timed copy, read + write counted). One convention, the performance
    model's: a float32 worker is modelled as ``Dtype.FP32``, which counts 4-byte weights and KV
    and runs its matmuls at half the kind's ``bf16_tflops``; so a float32 matmul rate is doubled
    into that field, and the copy rate is the bytes/s the host moved, as measured. A CPU worker
    is one socket: no interconnect counts. A peak that is missing or not a positive number is
    refused, naming it. ``core_cache_mb``: the cache private to one core, as the sidecar's
    ``host.core_cache_mb`` recorded it (0: not recorded, nothing taken to stay cached).
    """
    rates = {}
    for key in ("matmul_tflops", "copy_gbps"):
        raw = peaks.get(key)
        value = float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else 0.0
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgument(
                f"measured_peaks.{key} must be a positive number, got {raw!r}", field=key
            )
        rates[key] = value
    fp32 = _VALUE_BYTES.get(dtype, 4) == 4
    tflops = rates["matmul_tflops"] * (2 if fp32 else 1)
    return dataclasses.replace(
        CPU_HOST,
        name=CPU_HOST.name if hardware == "cpu" else hardware,
        bf16_tflops=tflops,
        int8_tops=tflops,
        hbm_tbps=rates["copy_gbps"] / 1e3,
        hbm_gb=memory_gb,
        core_cache_mb=core_cache_mb,
    )


@dataclass(frozen=True)
class _CpuHost:
    """What a CPU profile's sidecar says of its host: the peaks, and the probe at the start."""

    peaks: Mapping[str, object] | None  # None: no usable sidecar
    memory_gb: float
    dtype: str
    core_cache_mb: float = 0.0

    @classmethod
    def read(cls, hardware: str, sidecar: Path) -> _CpuHost:
        try:
            data = json.loads(sidecar.read_text())
            host = data["host"]
            peaks = dict(host["measured_peaks"])
            memory = float(host.get("memory_gb", CPU_HOST.hbm_gb))
            dtype = str(data.get("worker", {}).get("dtype", "float32"))
            cache = _positive(host.get("core_cache_mb"))
            cpu_kind(hardware, peaks, memory, dtype)  # usable?
            return cls(peaks, memory, dtype, cache)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidArgument):
            return cls(None, CPU_HOST.hbm_gb, "float32")

    def kind(self, hardware: str, speed: HostSpeed = UNPROBED) -> GpuKind:
        if self.peaks is None and speed == UNPROBED:
            return dataclasses.replace(
                CPU_HOST, name=CPU_HOST.name if hardware == "cpu" else hardware
            )
        nominal = {"matmul_tflops": CPU_HOST.bf16_tflops / 2, "copy_gbps": CPU_HOST.hbm_tbps * 1e3}
        peaks = scaled_peaks(self.peaks or nominal, speed)
        return cpu_kind(hardware, peaks, self.memory_gb, self.dtype, self.core_cache_mb)


def _positive(value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if ok else 0.0  # type: ignore[arg-type]
    return number if math.isfinite(number) and number > 0 else 0.0


def scaled_peaks(peaks: Mapping[str, object], speed: HostSpeed) -> dict[str, object]:
    """``peaks`` at a row's host speed.

    Where the row carries the worker's CPU share and the sidecar the core's rates per CPU
    second (``cpu_matmul_tflops``/``cpu_copy_gbps``): those rates times the share, the rate
    the worker itself had over that run (a probe between runs samples the host, not what
    the worker got). Else each peak times the row's probe over the probe at the start (the
    sidecar's ``probe_matmul_gflops``/``probe_copy_gbps``); a sidecar without the start's
    probe: the row's probe figure is taken as the peak itself."""
    out = dict(peaks)
    per_cpu = [_positive(peaks.get(k)) for k in ("cpu_matmul_tflops", "cpu_copy_gbps")]
    if speed.cpu_share is not None and all(per_cpu):
        out["matmul_tflops"] = per_cpu[0] * speed.cpu_share
        out["copy_gbps"] = per_cpu[1] * speed.cpu_share
        return out
    for peak, probe, row, unit in (
        ("matmul_tflops", "probe_matmul_gflops", speed.matmul_gflops, 1e3),
        ("copy_gbps", "probe_copy_gbps", speed.copy_gbps, 1.0),
    ):
        if row is None:
            continue
        start = _positive(peaks.get(probe))
        base = _positive(peaks.get(peak))
        out[peak] = base * row / start if start and base else row / unit
    return out


def cpu_kind_from_sidecar(hardware: str, sidecar: Path, speed: HostSpeed = UNPROBED) -> GpuKind:
    """``cpu_kind`` of the peaks a profile's JSON sidecar (``OUT.json``) recorded, at a row's
    host ``speed`` where the row carries one (``scaled_peaks``).

    Without a readable sidecar, or with unusable peaks: ``CPU_HOST``'s nominal figures under
    the profile's name (a hand-written CSV still loads; its kind says it was not measured), or
    the row's own probe figures where it carries them.
    """
    return _CpuHost.read(hardware, sidecar).kind(hardware, speed)


def _int_field(row: Mapping[str, str], key: str, where: str) -> int:
    raw = (row.get(key) or "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(
            f"{where}: {key} must be an integer, got {raw!r}", field=key
        ) from None
    if value <= 0:
        raise InvalidArgument(f"{where}: {key} must be > 0, got {value}", field=key)
    return value


def _ms_field(row: Mapping[str, str], key: str, where: str) -> float:
    raw = (row.get(key) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(
            f"{where}: {key} must be a number of ms, got {raw!r}", field=key
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{where}: {key} must be a positive time in ms, got {raw}", field=key)
    return value / 1e3


def _speed_field(row: Mapping[str, str | None], key: str, where: str) -> float | None:
    raw = (row.get(key) or "").strip()
    if not raw:
        return None  # the column is optional, and so is its value on a row
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"{where}: {key} must be a number, got {raw!r}", field=key) from None
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{where}: {key} must be a positive rate, got {raw}", field=key)
    return value


def _host_speed(row: Mapping[str, str | None], where: str) -> HostSpeed:
    mm, cp = (_speed_field(row, k, where) for k in HOST_COLUMNS)
    return HostSpeed(mm, cp, _speed_field(row, SHARE_COLUMN, where))


_Run = tuple[float, HostSpeed]  # a repeat's time and the host's speed around it


def _median_run(runs: Sequence[_Run]) -> _Run:
    """The median time, with the host speed of the run(s) that took it: a time is paired with
    the speed it ran at (for an even count, the two middle runs' mean time and mean speeds)."""
    ordered = sorted(runs, key=lambda r: r[0])
    mid = len(ordered) // 2
    middle = ordered[mid : mid + 1] if len(ordered) % 2 else ordered[mid - 1 : mid + 1]
    seconds = statistics.fmean(r[0] for r in middle)

    def mean(values: list[float | None]) -> float | None:
        return None if None in values else statistics.fmean(v for v in values if v is not None)

    speed = HostSpeed(
        mean([r[1].matmul_gflops for r in middle]),
        mean([r[1].copy_gbps for r in middle]),
        mean([r[1].cpu_share for r in middle]),
    )
    return seconds, speed


def load_measurements(path: Path) -> list[Measurement]:
    """Medians per configuration; a missing column or a bad value names file, line and field."""
    prefill: dict[tuple[str, int, int, int], list[_Run]] = defaultdict(list)
    decode: dict[tuple[str, int, int, int, int], list[_Run]] = defaultdict(list)
    models: set[str] = set()
    hosts: dict[str, _CpuHost] = {}  # CPUs, which no catalogue holds
    try:
        fh = path.open(newline="")
    except OSError as err:
        raise InvalidArgument(f"{path}: cannot read ({err.strerror})", field="path") from None
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InvalidArgument(f"{path}:1: missing column {missing[0]!r}", field=missing[0])
        for line, row in enumerate(reader, start=2):
            where = f"{path}:{line}"
            hw = (row.get("hardware") or "").strip()
            speed = _host_speed(row, where)
            if hw.lower().startswith("cpu"):
                if hw not in hosts:
                    hosts[hw] = _CpuHost.read(hw, path.with_suffix(".json"))
            else:
                hardware_kind(hw, where)
                speed = UNPROBED  # the probe times the profiler's CPU, never a GPU
            models.add((row.get("model") or "").strip())
            tp, p, b, t = (
                _int_field(row, k, where)
                for k in ("tensor_parallel", "prompt_size", "batch_size", "token_size")
            )
            prefill[(hw, tp, p, b)].append((_ms_field(row, "prompt_time", where), speed))
            decode[(hw, tp, p, b, t)].append((_ms_field(row, "token_time", where), speed))
    if not decode:
        raise InvalidArgument(f"{path}: no measurements", field="path")
    if len(models) > 1:
        raise InvalidArgument(f"{path}: one model per file, found {sorted(models)}", field="model")
    model = models.pop()
    kinds: dict[tuple[str, HostSpeed], GpuKind] = {}

    def median(hw: str, key: tuple[int, ...], phase: Phase, runs: Sequence[_Run]) -> Measurement:
        seconds, speed = _median_run(runs)
        kind = None
        if hw in hosts:  # a CPU: its sidecar's peaks at this configuration's host speed
            kind = kinds.setdefault((hw, speed), hosts[hw].kind(hw, speed))
        tp, p, b, t = (*key, 0)[:4]
        return Measurement(hw, tp, p, b, t, phase, seconds, model, kind)

    out = [median(k[0], k[1:], Phase.PREFILL, v) for k, v in sorted(prefill.items())]
    out += [median(k[0], k[1:], Phase.DECODE, v) for k, v in sorted(decode.items())]
    return out


def inconsistent(data: Iterable[Measurement]) -> set[tuple[str, int, int, int]]:
    """Configurations (hardware, tp, prompt, batch) whose run did not hold its batch.

    Prefilling 2b prompts is strictly more work than b of the same prompts; a median that took
    less time says the run did not process the batch it names (the reference table's TP-2
    batch-64 rows: 0.8 s against 6.6 s for batch 32, and a decode step faster than batch 32's
    too). Both phases of such a configuration are set aside. The rule reads the physics of the
    measurement, not the model's error, and is applied to every file the same way.
    """
    prefill = {
        (m.hardware, m.tp, m.prompt_size, m.batch_size): m.seconds
        for m in data
        if m.phase is Phase.PREFILL
    }
    bad = set()
    for (hw, tp, p, b), seconds in prefill.items():
        half = prefill.get((hw, tp, p, b // 2)) if b % 2 == 0 else None
        if half is not None and seconds < half:
            bad.add((hw, tp, p, b))
    return bad


def screened(data: Sequence[Measurement]) -> tuple[list[Measurement], list[Measurement]]:
    """(kept, set aside): ``inconsistent`` configurations removed from both phases."""
    bad = inconsistent(data)
    kept = [m for m in data if (m.hardware, m.tp, m.prompt_size, m.batch_size) not in bad]
    aside = [m for m in data if (m.hardware, m.tp, m.prompt_size, m.batch_size) in bad]
    return kept, aside


def with_model(data: Iterable[Measurement], model: str) -> list[Measurement]:
    return [dataclasses.replace(m, model=model) for m in data]
