"""Fit the performance model's efficiency factors on measured inference times.

The reference measurements (Splitwise, Llama-2-70B on DGX-A100 / DGX-H100 / power-capped
DGX-H100 at TP 2, 4, 8) are the only ground truth the model has, so the factors of each GPU
kind are fitted on them by least squares on the log of predicted/measured time (relative
error, so a 50 ms step weighs as much as a 5 s prefill), with a soft-L1 loss so the file's
few anomalous rows (e.g. TP2 batch-64 prefill, faster than batch 32) cannot drag the fit.

The power-capped H100 is modelled as H100 with a single extra factor, ``compute_scale``
(clocks kept under the cap): its decode times equal H100's and its prefill is uniformly slower,
which is what a compute cap on a bandwidth-bound decode predicts. H100 and its capped variant
are fitted jointly, sharing every other factor.

Refit and print the constants for ``perf_factors.SHIPPED_FACTORS``::

    .venv/bin/python -m fleetshift_daemon.core.calibration \
        ../shared/reference/splitwise_perf_llama2_70b.csv
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares  # type: ignore[import-untyped]

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM, H100_SXM_PCAP70, GpuKind
from fleetshift_daemon.core.perf_factors import CalibrationKey, EfficiencyFactors, KindFactors
from fleetshift_daemon.core.perfmodel import Deployment, ModelArch, PerfModel, llama2_70b

# hardware column of the reference file -> (kind modelled, kind whose factors it shares)
HARDWARE_KINDS: dict[str, GpuKind] = {
    "a100-80gb": A100_SXM_80GB,
    "h100-80gb": H100_SXM,
    "h100-80gb-pcap": H100_SXM_PCAP70,
}
_FIT_GROUPS: dict[str, tuple[str, ...]] = {
    "A100-SXM-80GB": ("A100-SXM-80GB",),
    "H100-SXM": ("H100-SXM", "H100-SXM-PCAP70"),
}
_CAPPED = {"H100-SXM-PCAP70": "H100-SXM"}

# name, lower bound, upper bound, initial value
_PARAMS: tuple[tuple[str, float, float, float], ...] = (
    ("compute_eff", 0.05, 0.8, 0.5),  # the file has no TP=1: cap MFU at a plausible 80 %
    ("tp_scaling", 0.0, 1.0, 0.2),
    ("bw_eff", 0.2, 1.0, 0.7),
    ("comm_eff", 0.005, 1.0, 0.3),
    ("allreduce_latency_s", 0.0, 5e-4, 3e-5),
    ("prefill_overhead_s", 0.0, 0.2, 0.01),
    ("decode_overhead_s", 0.0, 0.2, 0.005),
    ("knee_slowdown", 0.0, 2.0, 0.3),
)
# The knee is a kink: least squares cannot move it, so it is chosen from a grid.
KNEE_GRID: tuple[float, ...] = (1024.0, 1536.0, 2048.0, 3072.0, 4096.0, 6144.0)


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

    @property
    def kind(self) -> GpuKind:
        return HARDWARE_KINDS[self.hardware]


def load_measurements(path: Path) -> list[Measurement]:
    """Medians per configuration: prefill keyed without token_size (it does not depend on it)."""
    prefill: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[str, int, int, int, int], list[float]] = defaultdict(list)
    model = ""
    with path.open(newline="") as fh:
        for i, row in enumerate(csv.DictReader(fh), start=2):
            model = model or row.get("model") or ""
            hw = row["hardware"]
            if hw not in HARDWARE_KINDS:
                raise InvalidArgument(f"{path}:{i}: unknown hardware {hw!r}", field="hardware")
            tp, p, b, t = (
                int(row["tensor_parallel"]),
                int(row["prompt_size"]),
                int(row["batch_size"]),
                int(row["token_size"]),
            )
            prefill[(hw, tp, p, b)].append(float(row["prompt_time"]) / 1e3)
            decode[(hw, tp, p, b, t)].append(float(row["token_time"]) / 1e3)
    out = [
        Measurement(hw, tp, p, b, 0, Phase.PREFILL, statistics.median(v), model)
        for (hw, tp, p, b), v in sorted(prefill.items())
    ]
    out += [
        Measurement(hw, tp, p, b, t, Phase.DECODE, statistics.median(v), model)
        for (hw, tp, p, b, t), v in sorted(decode.items())
    ]
    return out


def predict(model: PerfModel, arch: ModelArch, m: Measurement) -> float:
    dep = Deployment(arch=arch, gpu=m.kind, tp=m.tp)
    if m.phase is Phase.PREFILL:
        return model.prefill_time_s(dep, [m.prompt_size] * m.batch_size)
    # token_time is the mean step over the generation: mean context is prompt + half the output
    ctx = m.batch_size * (m.prompt_size + m.token_size // 2)
    return model.decode_step_time_s(dep, m.batch_size, ctx)


def _factors_from_vector(x: Sequence[float], cap: float | None, knee: float) -> KindFactors:
    values = {name: float(v) for (name, *_), v in zip(_PARAMS, x, strict=True)}
    return KindFactors(**values, compute_scale=1.0 if cap is None else cap, knee_tokens=knee)


def fit_group(
    group: str, members: tuple[str, ...], data: Sequence[Measurement], arch: ModelArch
) -> dict[str, KindFactors]:
    best: tuple[float, dict[str, KindFactors]] | None = None
    for knee in KNEE_GRID:
        cost, factors = _fit_group_at(group, members, data, arch, knee)
        if best is None or cost < best[0]:
            best = (cost, factors)
    assert best is not None
    return best[1]


def _fit_group_at(
    group: str,
    members: tuple[str, ...],
    data: Sequence[Measurement],
    arch: ModelArch,
    knee: float,
) -> tuple[float, dict[str, KindFactors]]:
    rows = [m for m in data if m.kind.name in members]
    capped = [k for k in members if k in _CAPPED]
    lo = [p[1] for p in _PARAMS] + [0.3] * len(capped)
    hi = [p[2] for p in _PARAMS] + [1.0] * len(capped)
    x0 = [p[3] for p in _PARAMS] + [0.8] * len(capped)
    measured = np.log(np.array([m.seconds for m in rows]))

    def build(x: np.ndarray) -> dict[str, KindFactors]:
        base = list(x[: len(_PARAMS)])
        out = {group: _factors_from_vector(base, None, knee)}
        for i, name in enumerate(capped):
            out[name] = _factors_from_vector(base, float(x[len(_PARAMS) + i]), knee)
        return out

    def residuals(x: np.ndarray) -> np.ndarray:
        model = PerfModel(EfficiencyFactors(per_kind=build(x)))
        pred = np.array([predict(model, arch, m) for m in rows])
        return np.asarray(np.log(pred) - measured)

    result = least_squares(
        residuals, np.array(x0), bounds=(np.array(lo), np.array(hi)), loss="soft_l1", f_scale=0.02
    )
    return float(result.cost), build(np.asarray(result.x))


def fit(data: Sequence[Measurement], arch: ModelArch | None = None) -> EfficiencyFactors:
    arch = arch or llama2_70b()
    per_kind: dict[str, KindFactors] = {}
    for group, members in _FIT_GROUPS.items():
        per_kind.update(fit_group(group, members, data, arch))
    return EfficiencyFactors(per_kind=per_kind, aliases={"H200-SXM": "H100-SXM"})


def fit_calibrations(
    data: Sequence[Measurement], arch: ModelArch
) -> dict[CalibrationKey, KindFactors]:
    """Factors fitted on one model's measurements, keyed (model, GPU kind) for ``PerfModel``.

    Only the kinds the data measured get a key: a kind whose factors came from its fitting
    partner (H100 for the power-capped H100) is measured too, since its rows were in the fit.
    """
    measured = {m.kind.name for m in data}
    factors = fit(data, arch)
    return {(arch.name, kind): kf for kind, kf in factors.per_kind.items() if kind in measured}


@dataclass(frozen=True)
class FitError:
    kind: str
    phase: Phase
    n: int
    median_abs_pct: float
    p90_abs_pct: float
    max_abs_pct: float
    median_bias_pct: float = 0.0  # signed: > 0 predicts slower than measured


def fit_errors(
    factors: EfficiencyFactors,
    data: Iterable[Measurement],
    arch: ModelArch | None = None,
    calibrations: Mapping[CalibrationKey, KindFactors] | None = None,
) -> list[FitError]:
    """Median, p90 and max absolute % error and the signed median bias, per kind and phase."""
    arch = arch or llama2_70b()
    model = PerfModel(factors, calibrations=calibrations)
    errs: dict[tuple[str, Phase], list[float]] = defaultdict(list)
    for m in data:
        errs[(m.kind.name, m.phase)].append((predict(model, arch, m) / m.seconds - 1.0) * 100.0)
    out = []
    for (k, ph), signed in sorted(errs.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
        v = [abs(e) for e in signed]
        out.append(
            FitError(
                k,
                ph,
                len(v),
                statistics.median(v),
                float(np.percentile(v, 90)),
                max(v),
                statistics.median(signed),
            )
        )
    return out


def format_factors(per_kind: Mapping[str, KindFactors]) -> str:
    lines = ["SHIPPED_FACTORS: dict[str, KindFactors] = {"]
    for name, kf in per_kind.items():
        lines.append(f'    "{name}": KindFactors(')
        for f in fields(KindFactors):
            value = getattr(kf, f.name)
            value = 0.0 if abs(value) < 1e-9 else value
            if f.name == "compute_scale" and value == 1.0:
                continue
            lines.append(f"        {f.name}={float(f'{value:.4g}')!r},")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m fleetshift_daemon.core.calibration PERF_CSV", file=sys.stderr)
        return 2
    data = load_measurements(Path(args[0]))
    factors = fit(data)
    print(format_factors(factors.per_kind))
    print()
    for e in fit_errors(factors, data):
        print(
            f"{e.kind:18s} {e.phase.value:8s} n={e.n:3d} median |err| {e.median_abs_pct:5.1f}% "
            f"p90 {e.p90_abs_pct:5.1f}% max {e.max_abs_pct:6.1f}%"
        )
    return 0 if all(not math.isnan(e.median_abs_pct) for e in fit_errors(factors, data)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
