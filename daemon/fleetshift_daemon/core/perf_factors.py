"""The few efficiency factors that turn datasheet figures into measured step times.

A GPU never reaches its datasheet peak; how far it falls short depends on the kind, the phase
and the serving stack. Rather than tabulate times, the model keeps a handful of factors per
GPU kind, fitted on real measurements (see ``calibration.py``), so that it extrapolates to
models, batch shapes and GPU kinds that were never measured (H200 borrows H100's factors with
its own bandwidth and memory; an uncalibrated kind gets the mean of the calibrated ones).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING as MISSING_DEFAULT
from dataclasses import dataclass, field, fields
from typing import Any

from fleetshift_common.errors import InvalidArgument

# (model name, GPU kind name): what a per-model calibration is fitted for and looked up by.
CalibrationKey = tuple[str, str]


@dataclass(frozen=True)
class KindFactors:
    compute_eff: float  # fraction of dense peak the GEMMs reach at TP=1
    tp_scaling: float  # gamma: compute efficiency at TP t is compute_eff * t**-gamma
    bw_eff: float  # fraction of HBM bandwidth reached streaming weights and KV
    comm_eff: float  # fraction of one-direction link bandwidth an all-reduce reaches
    allreduce_latency_s: float  # fixed cost of one all-reduce per log2(TP) step
    prefill_overhead_s: float  # fixed cost of one prefill pass (launches, scheduling)
    decode_overhead_s: float  # fixed cost of one decode step
    compute_scale: float = 1.0  # clocks kept under a power cap (1.0 = uncapped)
    # Measured stacks slow down per token once one prefill pass exceeds a few thousand tokens
    # (the Splitwise data: ~0.07 ms/token up to 2k tokens on H100 TP8, ~0.10 beyond): GEMM
    # work past knee_tokens costs (1 + knee_slowdown) times as much. 0 = no knee.
    knee_tokens: float = 0.0
    knee_slowdown: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{f.name} must be finite and >= 0", field=f.name)
        for name in ("compute_eff", "bw_eff", "comm_eff", "compute_scale"):
            if not 0 < getattr(self, name) <= 1.0:
                raise InvalidArgument(f"{name} must be in (0, 1]", field=name)

    def to_dict(self) -> dict[str, float]:
        """Plain numbers by factor name, for storing a calibration as JSON (never pickle)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "factors") -> KindFactors:
        """The inverse of ``to_dict``; an unknown, missing or non-numeric key is named."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidArgument(f"{where}.{unknown[0]}: unknown factor", field=unknown[0])
        values: dict[str, float] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is not MISSING_DEFAULT:
                    continue
                raise InvalidArgument(f"{where}.{f.name} is required", field=f.name)
            raw = data[f.name]
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                raise InvalidArgument(f"{where}.{f.name} must be a number", field=f.name)
            values[f.name] = float(raw)
        return cls(**values)


@dataclass(frozen=True)
class EfficiencyFactors:
    per_kind: Mapping[str, KindFactors] = field(hash=False)
    aliases: Mapping[str, str] = field(default_factory=dict, hash=False)
    fallback: KindFactors | None = None

    def for_kind(self, kind_name: str) -> KindFactors:
        if kind_name in self.per_kind:
            return self.per_kind[kind_name]
        alias = self.aliases.get(kind_name)
        if alias is not None and alias in self.per_kind:
            return self.per_kind[alias]
        if self.fallback is not None:
            return self.fallback
        return mean_factors(tuple(self.per_kind.values()))

    def is_calibrated(self, kind_name: str) -> bool:
        return kind_name in self.per_kind


def mean_factors(items: tuple[KindFactors, ...]) -> KindFactors:
    """Geometric mean of each factor (uncapped): the prior for a GPU kind never measured."""
    if not items:
        raise InvalidArgument("no calibrated factors to average", field="per_kind")
    values = {}
    for f in fields(KindFactors):
        xs = [max(getattr(k, f.name), 1e-12) for k in items]
        values[f.name] = math.exp(sum(math.log(x) for x in xs) / len(xs))
    values["compute_scale"] = 1.0
    if any(k.knee_tokens == 0 for k in items):
        values["knee_tokens"] = values["knee_slowdown"] = 0.0
    return KindFactors(**values)


# Fitted on /work/shared/reference/splitwise_perf_llama2_70b.csv (Llama-2-70B fp16, medians of
# ~5 repeats per configuration). Refit with:
#   .venv/bin/python -m fleetshift_daemon.core.calibration \
#       ../shared/reference/splitwise_perf_llama2_70b.csv
# which prints this block. "H100-SXM-PCAP70" is the power-capped H100 of that file: H100's
# factors with a fitted compute_scale (decode is bandwidth-bound and did not slow down).
SHIPPED_FACTORS: dict[str, KindFactors] = {
    "A100-SXM-80GB": KindFactors(
        compute_eff=0.8,
        tp_scaling=0.2376,
        bw_eff=0.9499,
        comm_eff=1.0,
        allreduce_latency_s=5.185e-05,
        prefill_overhead_s=0.0,
        decode_overhead_s=0.01076,
        knee_tokens=3072.0,
        knee_slowdown=0.683,
    ),
    "H100-SXM": KindFactors(
        compute_eff=0.8,
        tp_scaling=0.4161,
        bw_eff=0.7045,
        comm_eff=1.0,
        allreduce_latency_s=4.83e-05,
        prefill_overhead_s=0.0,
        decode_overhead_s=0.0,
        knee_tokens=2048.0,
        knee_slowdown=0.3464,
    ),
    "H100-SXM-PCAP70": KindFactors(
        compute_eff=0.8,
        tp_scaling=0.4161,
        bw_eff=0.7045,
        comm_eff=1.0,
        allreduce_latency_s=4.83e-05,
        prefill_overhead_s=0.0,
        decode_overhead_s=0.0,
        compute_scale=0.7549,
        knee_tokens=2048.0,
        knee_slowdown=0.3464,
    ),
}
SHIPPED_ALIASES: dict[str, str] = {"H200-SXM": "H100-SXM"}


def shipped_factors() -> EfficiencyFactors:
    return EfficiencyFactors(per_kind=dict(SHIPPED_FACTORS), aliases=dict(SHIPPED_ALIASES))
