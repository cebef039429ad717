"""Fit the performance model's factors on measured inference times, and check a fit.

Each GPU kind's factors are fitted by least squares on the log of predicted/measured time
(relative error, so a 30 ms step weighs as much as a 5 s prefill), with a soft-L1 loss so a
few odd rows cannot drag the fit, inside the factors' physical bounds
(``perf_factors.FACTOR_BOUNDS``), and with each factor's prior (``perf_factors.PRIORS``) as
one more residual: a departure of one prior width costs as much as one row ``PRIOR_WEIGHT``
off, so where the rows tell two factors apart the rows decide, and where they cannot (a
Python engine's per-row dispatch against its per-token compute) the prior does instead of
chance. A factor no profile can move at all (the link's per-hop latency against a stack's
per-worker time) is not fitted: ``perf_factors.FIXED_FACTORS``. Configurations
whose run did not hold its batch are set aside first (``measurements.inconsistent``). The
long-pass threshold is a kink least squares cannot move, so it is chosen from
``LONG_PASS_GRID`` on the fitting data.

Only what the rows can move is fitted (``fitted_names``): link and per-worker factors need
rows at TP > 1, the long-pass slowdown and the eager per-layer prefill time are a GPU serving
stack's, a Python engine's per-row dispatch is the reference engine's (a CPU kind); the rest
keep their start values and are not reported as fitted.

Rows of several models (each with its architecture) can be fitted together: the factors are
hardware and engine properties, so one set per kind must describe every model measured there.

The power-capped H100 is H100 with one extra factor, ``compute_scale``: its decode times equal
H100's and every prefill pass is uniformly slower, which is what a cap on the clock of a
power-hungry, compute-bound pass and a bandwidth-bound decode predicts. The two are fitted
jointly, sharing every other factor.

Refit and print the constants for ``perf_factors.SHIPPED_FACTORS``::

    .venv/bin/python -m fleetshift_daemon.core.calibration \
        ../shared/reference/splitwise_perf_llama2_70b.csv
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares  # type: ignore[import-untyped]

from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.gpus import GpuKind
from fleetshift_daemon.core.measurements import (
    HARDWARE_KINDS,
    Measurement,
    hardware_kind,
    load_measurements,
    screened,
)
from fleetshift_daemon.core.perf_factors import (
    FACTOR_BOUNDS,
    FIXED_FACTORS,
    PRIORS,
    SHIPPED_ALIASES,
    CalibrationKey,
    EfficiencyFactors,
    KindFactors,
)
from fleetshift_daemon.core.perfmodel import (
    REFERENCE_CPU_ENGINE,
    Deployment,
    Dtype,
    ModelArch,
    PerfCoefficients,
    PerfModel,
    engine_shape,
    llama2_70b,
)

__all__ = [
    "HARDWARE_KINDS",
    "FitError",
    "Measurement",
    "fit",
    "fit_calibrations",
    "fit_errors",
    "fit_group",
    "fit_rows",
    "load_measurements",
    "predict",
]

# kind -> the kind whose factors it shares, differing only in compute_scale
CAPPED: dict[str, str] = {"H100-SXM-PCAP70": "H100-SXM"}
# every factor a fit can move, in a fixed order (``fitted_names`` picks those rows can tell)
FITTED = (
    "gemm_eff",
    "bw_eff",
    "link_eff",
    "step_overhead_s",
    "worker_overhead_s",
    "seq_overhead_s",
    "prefill_seq_overhead_s",
    "long_pass_token_s",
    "layer_row_s",
    "prefill_layer_s",
)
LINK = ("link_eff", "worker_overhead_s")
# a prior's residual: one width off costs as much as one row this far off in log time (5 %)
PRIOR_WEIGHT = 0.05
# where a fit starts: mid-range fractions, times of the order a serving stack shows
START: dict[str, float] = {
    "gemm_eff": 0.6,
    "bw_eff": 0.8,
    "link_eff": 0.5,
    "step_overhead_s": 0.01,
    "seq_overhead_s": 1e-4,
    "prefill_seq_overhead_s": 1e-3,
    "long_pass_token_s": 5e-5,
    "worker_overhead_s": 1e-3,
    "layer_row_s": 7.5e-5,
    "prefill_layer_s": 1e-4,
}
LONG_PASS_GRID: tuple[float, ...] = (1024.0, 1536.0, 2048.0, 3072.0, 4096.0)


@dataclass(frozen=True)
class Row:
    """One measurement with the model and dtype it was taken on."""

    m: Measurement
    arch: ModelArch
    dtype: Dtype = Dtype.BF16


def predict(model: PerfModel, arch: ModelArch, m: Measurement, dtype: Dtype = Dtype.BF16) -> float:
    dep = Deployment(arch=arch, gpu=m.kind, tp=m.tp, dtype=dtype)
    if m.phase is Phase.PREFILL:
        return model.prefill_time_s(dep, [m.prompt_size] * m.batch_size)
    # token_time is the mean step over the generation: mean context is prompt + half the output
    ctx = m.batch_size * (m.prompt_size + m.token_size // 2)
    return model.decode_step_time_s(dep, m.batch_size, ctx)


def _groups(rows: Sequence[Row]) -> dict[str, list[str]]:
    """Fitting groups: each measured kind alone, a capped kind with the kind it caps."""
    kinds = sorted({r.m.kind.name for r in rows})
    groups: dict[str, list[str]] = {}
    for k in kinds:
        base = CAPPED.get(k, k)
        if base in kinds or base == k:
            groups.setdefault(base, []).append(k)
        else:  # a capped kind measured without its base: fitted as a kind of its own
            groups.setdefault(k, []).append(k)
    return groups


def factor_names(kind: GpuKind, multi_gpu: bool) -> tuple[str, ...]:
    """The factors rows of ``kind`` can move (at TP > 1 when ``multi_gpu``): the module doc."""
    reference = engine_shape(kind) == REFERENCE_CPU_ENGINE
    skip = set() if multi_gpu else set(LINK)
    skip |= {"long_pass_token_s", "prefill_layer_s"} if reference else {"layer_row_s"}
    return tuple(n for n in FITTED if n not in skip)


def fitted_names(rows: Sequence[Row]) -> tuple[str, ...]:
    """The factors ``rows`` (one fitting group) can move."""
    return factor_names(rows[0].m.kind, any(r.m.tp > 1 for r in rows))


def _kind_factors(
    names: Sequence[str], x: Sequence[float], knee: float, scale: float = 1.0
) -> KindFactors:
    values = {n: START[n] for n in FITTED} | dict(FIXED_FACTORS)
    values.update({"layer_row_s": 0.0, "long_pass_token_s": 0.0, "prefill_layer_s": 0.0})
    values.update({name: float(v) for name, v in zip(names, x, strict=True)})
    knee = knee if values["long_pass_token_s"] > 0 else 0.0
    return KindFactors(**values, long_pass_tokens=knee, compute_scale=scale)


@dataclass(frozen=True)
class _Features:
    """Rows as arrays, grouped by deployment, so one evaluation computes each deployment's
    coefficients once and every row's time with a few vector operations."""

    deps: list[Deployment]
    index: np.ndarray  # row -> its deployment
    prefill: np.ndarray  # bool
    total: np.ndarray  # prefill: tokens in the pass
    sum_sq: np.ndarray
    n_seqs: np.ndarray  # prefill: sequences; decode: batch
    ctx: np.ndarray  # decode: context tokens of the batch

    @classmethod
    def of(cls, rows: Sequence[Row]) -> _Features:
        deps: dict[Deployment, int] = {}
        index = []
        for r in rows:
            dep = Deployment(arch=r.arch, gpu=r.m.kind, tp=r.m.tp, dtype=r.dtype)
            index.append(deps.setdefault(dep, len(deps)))
        p = np.array([r.m.prompt_size for r in rows], dtype=float)
        b = np.array([r.m.batch_size for r in rows], dtype=float)
        t = np.array([r.m.token_size // 2 for r in rows], dtype=float)
        return cls(
            deps=list(deps),
            index=np.array(index),
            prefill=np.array([r.m.phase is Phase.PREFILL for r in rows]),
            total=p * b,
            sum_sq=b * p * p,
            n_seqs=b,
            ctx=b * (p + t),
        )

    def times(self, factors: Mapping[str, KindFactors]) -> np.ndarray:
        """What ``predict`` gives for every row, without a PerfModel per evaluation."""
        co = [_coefficients(d, factors[d.gpu.name]) for d in self.deps]
        c = {
            name: np.array([getattr(x, name) for x in co])[self.index]
            for name in (
                "p0",
                "p_tok",
                "p_sq",
                "p_seq",
                "d0",
                "d_seq",
                "d_ctx",
                "p_min",
                "p_row",
                "p_head",
                "d_row",
                "p_stall",
                "p_head_stall",
                "d_stall",
            )
        }
        knee = np.array([x.knee_tokens for x in co])[self.index]
        p_knee = np.array([x.p_knee for x in co])[self.index]
        chunk = np.array([x.row_chunk for x in co], dtype=float)[self.index]
        per = np.maximum(chunk, 1.0)  # chunked(n): n up to whole chunks (0 where unchunked)
        beyond = np.where(self.total > knee, self.total - np.minimum(knee, self.total), 0.0)
        prefill = c["p0"] + c["p_tok"] * self.total + c["p_sq"] * self.sum_sq
        prefill += c["p_row"] * np.ceil(self.total / per) * chunk
        prefill += c["p_head"] * np.ceil(self.n_seqs / per) * chunk
        prefill += c["p_stall"] * np.ceil(self.total / per) + c["p_head_stall"] * np.ceil(
            self.n_seqs / per
        )
        prefill = np.maximum(prefill + c["p_seq"] * self.n_seqs + p_knee * beyond, c["p_min"])
        decode = c["d0"] + c["d_seq"] * self.n_seqs + c["d_ctx"] * self.ctx
        decode += c["d_row"] * np.ceil(self.n_seqs / per) * chunk
        decode += c["d_stall"] * np.maximum(np.ceil(self.n_seqs / per) - 1, 0.0)
        return np.asarray(np.where(self.prefill, prefill, decode))


def _coefficients(dep: Deployment, kf: KindFactors) -> PerfCoefficients:
    return PerfModel(EfficiencyFactors(per_kind={dep.gpu.name: kf})).coefficients(dep)


def _prior_residuals(names: Sequence[str], x: np.ndarray) -> np.ndarray:
    out = [
        PRIOR_WEIGHT * (math.log(max(float(v), 1e-15)) - math.log(PRIORS[n][0])) / PRIORS[n][1]
        for n, v in zip(names, x, strict=True)
        if n in PRIORS
    ]
    return np.array(out)


def _fit_group(
    base: str, members: Sequence[str], rows: Sequence[Row], knee: float, start: Sequence[float]
) -> tuple[float, dict[str, KindFactors]]:
    names = fitted_names(rows)
    capped = [k for k in members if k != base]
    lo = [FACTOR_BOUNDS[n][0] for n in names] + [FACTOR_BOUNDS["compute_scale"][0]] * len(capped)
    hi = [FACTOR_BOUNDS[n][1] for n in names] + [1.0] * len(capped)
    x0 = np.clip(np.array(list(start) + [0.8] * len(capped)), lo, hi)
    measured = np.log(np.array([r.m.seconds for r in rows]))
    features = _Features.of(rows)

    def build(x: np.ndarray) -> dict[str, KindFactors]:
        base_x = list(x[: len(names)])
        out = {base: _kind_factors(names, base_x, knee)}
        for i, name in enumerate(capped):
            out[name] = _kind_factors(names, base_x, knee, float(x[len(names) + i]))
        return out

    def residuals(x: np.ndarray) -> np.ndarray:
        fit = np.log(features.times(build(x))) - measured
        return np.concatenate([fit, _prior_residuals(names, x[: len(names)])])

    result = least_squares(
        residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.02, x_scale="jac"
    )
    return float(result.cost), build(np.asarray(result.x))


def _screened_rows(rows: Sequence[Row]) -> list[Row]:
    """``rows`` without the configurations that did not hold their batch, model by model."""
    out: list[Row] = []
    for name in dict.fromkeys(r.arch.name for r in rows):
        mine = [r for r in rows if r.arch.name == name]
        keep = set(map(id, screened([r.m for r in mine])[0]))
        out += [r for r in mine if id(r.m) in keep]
    return out


def fit_rows(rows: Sequence[Row]) -> EfficiencyFactors:
    """Factors per measured kind fitted on ``rows`` (any mix of models), inconsistent set aside."""
    by_m = _screened_rows(rows)
    per_kind: dict[str, KindFactors] = {}
    for base, members in _groups(by_m).items():
        group_rows = [r for r in by_m if r.m.kind.name in members]
        names = fitted_names(group_rows)
        starts = ([START[n] for n in names], [sum(FACTOR_BOUNDS[n]) / 2 for n in names])
        knees = LONG_PASS_GRID if "long_pass_token_s" in names else (0.0,)
        best: tuple[float, dict[str, KindFactors]] | None = None
        for knee in knees:
            for start in starts:
                cost, factors = _fit_group(base, members, group_rows, knee, start)
                if best is None or cost < best[0]:
                    best = (cost, factors)
        assert best is not None
        per_kind.update(best[1])
    return EfficiencyFactors(per_kind=per_kind, aliases=dict(SHIPPED_ALIASES))


def fit_group(
    group: str,
    members: Sequence[str],
    data: Sequence[Measurement],
    arch: ModelArch,
    dtype: Dtype = Dtype.BF16,
) -> dict[str, KindFactors]:
    """Factors of the kinds ``members`` (a kind, or one with its capped variant) on ``data``.

    Kept for callers of the per-group fit (fs-12c's per-(model, kind) calibration): ``group``
    names the base kind, as before; the grouping itself follows ``CAPPED``.
    """
    rows = [Row(m, arch, dtype) for m in data if m.kind.name in members]
    return dict(fit_rows(rows).per_kind)


def fit(
    data: Sequence[Measurement], arch: ModelArch | None = None, dtype: Dtype = Dtype.BF16
) -> EfficiencyFactors:
    """Factors per kind fitted on one model's measurements (Llama-2-70B when not given)."""
    arch = arch or llama2_70b()
    return fit_rows([Row(m, arch, dtype) for m in data])


def fit_calibrations(
    data: Sequence[Measurement], arch: ModelArch, dtype: Dtype = Dtype.BF16
) -> dict[CalibrationKey, KindFactors]:
    """Factors fitted on one model's measurements, keyed (model, GPU kind) for ``PerfModel``."""
    measured = {m.kind.name for m in data}
    factors = fit(data, arch, dtype)
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


def summarize(errors: Mapping[tuple[str, Phase], Sequence[float]]) -> list[FitError]:
    """Signed % errors per (kind, phase) -> median, p90, max of |error| and the median bias."""
    out = []
    for (k, ph), signed in sorted(errors.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
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


def signed_errors(model: PerfModel, rows: Iterable[Row]) -> dict[tuple[str, Phase], list[float]]:
    errs: dict[tuple[str, Phase], list[float]] = defaultdict(list)
    for r in rows:
        pct = (predict(model, r.arch, r.m, r.dtype) / r.m.seconds - 1.0) * 100.0
        errs[(r.m.kind.name, r.m.phase)].append(pct)
    return errs


def fit_errors(
    factors: EfficiencyFactors,
    data: Iterable[Measurement],
    arch: ModelArch | None = None,
    calibrations: Mapping[CalibrationKey, KindFactors] | None = None,
    dtype: Dtype = Dtype.BF16,
) -> list[FitError]:
    """Median, p90 and max absolute % error and the signed median bias, per kind and phase.

    Configurations that did not hold their batch (``measurements.inconsistent``) are left out.
    """
    arch = arch or llama2_70b()
    kept, _ = screened(list(data))
    model = PerfModel(factors, calibrations=calibrations)
    return summarize(signed_errors(model, [Row(m, arch, dtype) for m in kept]))


def format_factors(per_kind: Mapping[str, KindFactors]) -> str:
    """``perf_factors.SHIPPED_FACTORS`` as Python: a capped kind (``CAPPED``) as its base
    kind's factors with its own ``compute_scale``, since that is all a joint fit gives it."""
    lines = ["SHIPPED_FACTORS: dict[str, KindFactors] = {"]
    capped = {k: b for k, b in CAPPED.items() if k in per_kind and b in per_kind}
    for name, kf in per_kind.items():
        if name in capped:
            continue
        lines.append(f'    "{name}": KindFactors(')
        for f in fields(KindFactors):
            value = getattr(kf, f.name)
            value = 0.0 if abs(value) < 1e-12 else value
            if value == f.default:
                continue  # at its default: no power cap, not a Python engine, no slowdown...
            lines.append(f"        {f.name}={_short(value)},")
        lines.append("    ),")
    lines.append("}")
    for name, base in capped.items():
        scale = _short(per_kind[name].compute_scale)
        lines.append(
            f'SHIPPED_FACTORS["{name}"] = replace(SHIPPED_FACTORS["{base}"], compute_scale={scale})'
        )
    return "\n".join(lines)


def _short(value: float) -> str:
    return repr(float(f"{value:.4g}"))


def at_bounds(kf: KindFactors, names: Sequence[str] = FITTED) -> list[str]:
    """Fitted factors (of ``names``) that ended within 0.1 % of the range of a bound."""
    out = []
    for name in names:
        lo, hi = FACTOR_BOUNDS[name]
        value = getattr(kf, name)
        if min(value - lo, hi - value) < 1e-3 * (hi - lo):
            out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m fleetshift_daemon.core.calibration PERF_CSV", file=sys.stderr)
        return 2
    data = load_measurements(Path(args[0]))
    factors = fit(data)
    print(format_factors(factors.per_kind))
    print()
    errors = fit_errors(factors, data)
    for e in errors:
        print(
            f"{e.kind:18s} {e.phase.value:8s} n={e.n:3d} median |err| {e.median_abs_pct:5.1f}% "
            f"p90 {e.p90_abs_pct:5.1f}% bias {e.median_bias_pct:+5.1f}% max {e.max_abs_pct:6.1f}%"
        )
    for kind, kf in factors.per_kind.items():
        pinned = at_bounds(kf, factor_names(hardware_kind(kind), multi_gpu=True))
        print(f"{kind}: at a bound: {', '.join(pinned) or 'none'}")
    return 0 if all(not math.isnan(e.median_abs_pct) for e in errors) else 1


if __name__ == "__main__":
    raise SystemExit(main())
