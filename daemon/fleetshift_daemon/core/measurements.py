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
    hardware: str, peaks: Mapping[str, object], memory_gb: float, dtype: str = "float32"
) -> GpuKind:
    """A CPU as a hardware kind: the peaks ``fleetshift profile`` measured on it, never invented.

    ``peaks``: ``matmul_tflops`` (a timed matrix product in the worker's ``dtype``) and
    ``copy_gbps`` (a timed copy, read + write counted). One convention, the performance
    model's: a float32 worker is modelled as ``Dtype.FP32``, which counts 4-byte weights and KV
    and runs its matmuls at half the kind's ``bf16_tflops``; so a float32 matmul rate is doubled
    into that field, and the copy rate is the bytes/s the host moved, as measured. A CPU worker
    is one socket: no interconnect counts. A peak that is missing or not a positive number is
    refused, naming it.
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
    )


def cpu_kind_from_sidecar(hardware: str, sidecar: Path) -> GpuKind:
    """``cpu_kind`` of the peaks a profile's JSON sidecar (``OUT.json``) recorded.

    Without a readable sidecar, or with unusable peaks: ``CPU_HOST``'s nominal figures under
    the profile's name (a hand-written CSV still loads; its kind says it was not measured).
    """
    try:
        data = json.loads(sidecar.read_text())
        host = data["host"]
        memory = float(host.get("memory_gb", CPU_HOST.hbm_gb))
        dtype = str(data.get("worker", {}).get("dtype", "float32"))
        return cpu_kind(hardware, host["measured_peaks"], memory, dtype)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidArgument):
        return dataclasses.replace(CPU_HOST, name=CPU_HOST.name if hardware == "cpu" else hardware)


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


def load_measurements(path: Path) -> list[Measurement]:
    """Medians per configuration; a missing column or a bad value names file, line and field."""
    prefill: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[str, int, int, int, int], list[float]] = defaultdict(list)
    models: set[str] = set()
    kinds: dict[str, GpuKind] = {}  # CPUs, which no catalogue holds
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
            if hw.lower().startswith("cpu"):
                kinds.setdefault(hw, cpu_kind_from_sidecar(hw, path.with_suffix(".json")))
            else:
                hardware_kind(hw, where)
            models.add((row.get("model") or "").strip())
            tp, p, b, t = (
                _int_field(row, k, where)
                for k in ("tensor_parallel", "prompt_size", "batch_size", "token_size")
            )
            prefill[(hw, tp, p, b)].append(_ms_field(row, "prompt_time", where))
            decode[(hw, tp, p, b, t)].append(_ms_field(row, "token_time", where))
    if not decode:
        raise InvalidArgument(f"{path}: no measurements", field="path")
    if len(models) > 1:
        raise InvalidArgument(f"{path}: one model per file, found {sorted(models)}", field="model")
    model = models.pop()
    out = [
        Measurement(hw, tp, p, b, 0, Phase.PREFILL, statistics.median(v), model, kinds.get(hw))
        for (hw, tp, p, b), v in sorted(prefill.items())
    ]
    out += [
        Measurement(hw, tp, p, b, t, Phase.DECODE, statistics.median(v), model, kinds.get(hw))
        for (hw, tp, p, b, t), v in sorted(decode.items())
    ]
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
