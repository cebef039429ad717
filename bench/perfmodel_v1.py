"""The performance model as it was before issue 12, frozen as the hold-out bench's baseline.

Its eight free factors per kind (compute_eff capped at 0.8, a TP-scaling exponent, bw_eff,
comm_eff, all-reduce latency per log2(TP) step and layer, prefill/decode overheads, a knee)
and its fit are copied from core/perfmodel.py, perf_factors.py and calibration.py at commit
be82904, so that bench/perf_holdout.py can fit and score today's model and the new one on the
same rows in the same run. Not used by the daemon.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares  # type: ignore[import-untyped]

from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.measurements import Measurement
from fleetshift_daemon.core.perfmodel import Deployment, ModelArch, PerfCoefficients, llama2_70b


@dataclass(frozen=True)
class V1Factors:
    compute_eff: float
    tp_scaling: float
    bw_eff: float
    comm_eff: float
    allreduce_latency_s: float
    prefill_overhead_s: float
    decode_overhead_s: float
    compute_scale: float = 1.0
    knee_tokens: float = 0.0
    knee_slowdown: float = 0.0


_A100 = V1Factors(0.8, 0.2376, 0.9499, 1.0, 5.185e-05, 0.0, 0.01076, 1.0, 3072.0, 0.683)
_H100 = V1Factors(0.8, 0.4161, 0.7045, 1.0, 4.83e-05, 0.0, 0.0, 1.0, 2048.0, 0.3464)
SHIPPED_V1: dict[str, V1Factors] = {
    "A100-SXM-80GB": _A100,
    "H100-SXM": _H100,
    "H100-SXM-PCAP70": replace(_H100, compute_scale=0.7549),
}
_PARAMS: tuple[tuple[str, float, float, float], ...] = (
    ("compute_eff", 0.05, 0.8, 0.5),
    ("tp_scaling", 0.0, 1.0, 0.2),
    ("bw_eff", 0.2, 1.0, 0.7),
    ("comm_eff", 0.005, 1.0, 0.3),
    ("allreduce_latency_s", 0.0, 5e-4, 3e-5),
    ("prefill_overhead_s", 0.0, 0.2, 0.01),
    ("decode_overhead_s", 0.0, 0.2, 0.005),
    ("knee_slowdown", 0.0, 2.0, 0.3),
)
KNEE_GRID = (1024.0, 1536.0, 2048.0, 3072.0, 4096.0, 6144.0)


def coefficients(dep: Deployment, kf: V1Factors) -> PerfCoefficients:
    arch, gpu, tp = dep.arch, dep.gpu, dep.tp
    compute_rate = gpu.bf16_tflops * 1e12 * tp * kf.compute_eff * kf.compute_scale
    compute_rate *= tp ** (-kf.tp_scaling)
    mem_rate = gpu.hbm_tbps * 1e12 * tp * kf.bw_eff
    n_allreduce = 2 * arch.n_layers
    steps = math.ceil(math.log2(tp)) if tp > 1 else 0
    link = gpu.interconnect_gbps * 1e9 / 2 * kf.comm_eff
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    comm_per_token = n_allreduce * ring * arch.hidden * 2 / link
    comm_fixed = n_allreduce * steps * kf.allreduce_latency_s
    gemm = 2 * arch.n_layers * arch.layer_params
    lm_head = 2 * arch.hidden * arch.vocab
    weights = (
        arch.n_layers * arch.layer_params * 2
        + (arch.param_count() - arch.n_layers * arch.layer_params) * 2
    )
    weights_s = weights / mem_rate
    kv = 2 * arch.n_layers * max(arch.n_kv_heads, tp) * arch.head_dim * 2
    return PerfCoefficients(
        p0=kf.prefill_overhead_s + weights_s + comm_fixed,
        p_tok=gemm / compute_rate + comm_per_token,
        p_sq=2 * arch.n_layers * arch.attn_dim / compute_rate,
        p_seq=lm_head / compute_rate,
        d0=kf.decode_overhead_s + weights_s + comm_fixed,
        d_seq=(gemm + lm_head) / compute_rate + comm_per_token,
        d_ctx=kv / mem_rate + 4 * arch.n_layers * arch.attn_dim / compute_rate,
        kv_capacity_tokens=0,
        kv_bytes_per_token=kv,
        knee_tokens=kf.knee_tokens if kf.knee_slowdown > 0 else math.inf,
        p_knee=kf.knee_slowdown * gemm / compute_rate,
    )


def predict(factors: dict[str, V1Factors], arch: ModelArch, m: Measurement) -> float:
    c = coefficients(Deployment(arch, m.kind, m.tp), factors[m.kind.name])
    if m.phase is Phase.PREFILL:
        n, p = m.batch_size, m.prompt_size
        return c.prefill_s(n * p, n * p * p, n)
    ctx = m.batch_size * (m.prompt_size + m.token_size // 2)
    return c.decode_s(m.batch_size, ctx)


def _fit_at(
    rows: Sequence[Measurement], arch: ModelArch, knee: float
) -> tuple[float, dict[str, V1Factors]]:
    capped = sorted({m.kind.name for m in rows} & {"H100-SXM-PCAP70"})
    base = "A100-SXM-80GB" if rows[0].kind.name.startswith("A100") else "H100-SXM"
    lo = [p[1] for p in _PARAMS] + [0.3] * len(capped)
    hi = [p[2] for p in _PARAMS] + [1.0] * len(capped)
    x0 = [p[3] for p in _PARAMS] + [0.8] * len(capped)
    measured = np.log([m.seconds for m in rows])

    def build(x: np.ndarray) -> dict[str, V1Factors]:
        values = {name: float(v) for (name, *_), v in zip(_PARAMS, x[: len(_PARAMS)], strict=True)}
        out = {base: V1Factors(**values, knee_tokens=knee)}
        for i, name in enumerate(capped):
            out[name] = V1Factors(
                **values, knee_tokens=knee, compute_scale=float(x[len(_PARAMS) + i])
            )
        return out

    def residuals(x: np.ndarray) -> np.ndarray:
        f = build(x)
        return np.log([predict(f, arch, m) for m in rows]) - measured

    r = least_squares(residuals, np.array(x0), bounds=(lo, hi), loss="soft_l1", f_scale=0.02)
    return float(r.cost), build(np.asarray(r.x))


def fit(data: Sequence[Measurement], arch: ModelArch | None = None) -> dict[str, V1Factors]:
    """Today's fit: A100 alone, H100 with its capped variant, the knee from a grid."""
    arch = arch or llama2_70b()
    out: dict[str, V1Factors] = {}
    for prefix in ("A100", "H100"):
        rows = [m for m in data if m.kind.name.startswith(prefix)]
        if rows:
            out.update(min((_fit_at(rows, arch, k) for k in KNEE_GRID), key=lambda t: t[0])[1])
    return out
