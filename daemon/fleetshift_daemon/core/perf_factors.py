"""The factors that turn datasheet figures into measured step times, each a physical quantity.

A GPU never reaches its datasheet peak, and a serving stack adds time of its own. Rather than
tabulate times, the model keeps a handful of factors per GPU kind, fitted on measurements
(``calibration.py``), so that it extrapolates to models, batch shapes and GPU kinds that were
never measured. Each factor is a property of the hardware or of the engine, not of one model:

- how close GEMMs come to the dense tensor peak (``gemm_eff``; the shape dependence, tile
  padding of every matrix dimension, is geometry: ``perfmodel.TILE_PAD``), and HBM streaming
  to its bandwidth (``bw_eff``);
- per all-reduce over the TP group's link (NVLink in a node): a latency per ring hop and the
  fraction of the link's one-direction bandwidth reached;
- the engine's fixed time per step (scheduling, launches), per step and per TP worker beyond
  the first (the engine drives t processes every step: inputs broadcast, results gathered),
  per sequence in a decode step (sampling, bookkeeping) and per sequence in a prefill pass;
  none scales with model size;
- ``layer_row_s``: a Python engine's dispatch per layer and token row (the reference engine
  calls attention once per query row and layer; a GPU serving engine batches it, so 0 there);
- the measured stacks' slowdown once one prefill pass holds more than ``long_pass_tokens``
  tokens (Splitwise: from 2-4k tokens on, on every kind and TP), as seconds per token beyond;
- ``compute_scale``: the clock a power cap leaves in power-hungry prefill passes (1 = none).

Every factor has physical bounds (``FACTOR_BOUNDS``); a fit that ends on one is reported.
Some factors are not identifiable from one model's profile (a link latency from a stack's own
per-worker time; a Python engine's per-layer dispatch from its per-token compute), so the fit
carries a prior for them (``PRIORS``): a centre taken from microbenchmarks and datasheets, not
from the fitted table, and a width; the data move a factor as far as they can tell it apart.
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

# factor -> (lower, upper) bound: fractions of a peak lie in (0, 1]; times are non-negative and
# below what any measured stack shows by an order of magnitude.
FACTOR_BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_eff": (0.02, 1.0),
    "bw_eff": (0.2, 1.0),
    "link_latency_s": (0.0, 1e-4),
    "link_eff": (0.02, 1.0),
    "step_overhead_s": (0.0, 0.2),
    "seq_overhead_s": (0.0, 0.005),
    "prefill_seq_overhead_s": (0.0, 0.1),
    "long_pass_token_s": (0.0, 1e-3),
    "long_pass_tokens": (0.0, 65536.0),
    "compute_scale": (0.3, 1.0),
    "worker_overhead_s": (0.0, 0.05),
    "layer_row_s": (0.0, 0.01),
}

# factor -> (centre, width as a natural-log standard deviation): what is known before a fit.
# gemm_eff: cuBLAS reaches ~70-85 % of the dense BF16 peak on large GEMMs (A100 ~250-280 of 312
# TFLOPS; Hopper without wgmma kernels less). bw_eff: a streaming copy reaches ~85-92 % of HBM
# peak. link_eff: NCCL's all-reduce bus bandwidth on NVSwitch reaches ~70-80 % of one direction
# for multi-MB messages. link_latency_s: an NCCL LL-protocol ring step over NVLink is ~1 us.
# prefill_seq_overhead_s: a serving stack's per-request work in a pass (~1 ms). layer_row_s:
# ~15 small torch ops of ~5 us each per query row and layer on an idle CPU core (the reference
# engine's attention loop); 0 is not a prior for GPU engines, they do not fit it at all.
PRIORS: dict[str, tuple[float, float]] = {
    "gemm_eff": (0.7, 0.2),
    "bw_eff": (0.85, 0.1),
    "link_eff": (0.7, 0.3),
    "link_latency_s": (1e-6, 1.0),
    "prefill_seq_overhead_s": (1e-3, 1.5),
    "layer_row_s": (7.5e-5, 1.5),
}


@dataclass(frozen=True)
class KindFactors:
    gemm_eff: float  # fraction of dense tensor peak reached by large (unpadded) GEMMs
    bw_eff: float  # fraction of HBM bandwidth reached streaming weights and KV
    link_latency_s: float  # per ring hop of an all-reduce (2 (t-1) hops each)
    link_eff: float  # fraction of one-direction link bandwidth an all-reduce reaches
    step_overhead_s: float  # engine time per step (prefill pass or decode step), any model
    seq_overhead_s: float  # engine time per sequence in a decode step
    prefill_seq_overhead_s: float = 0.0  # engine time per sequence in a prefill pass
    long_pass_token_s: float = 0.0  # extra seconds per token of a pass beyond long_pass_tokens
    long_pass_tokens: float = 0.0  # 0: no long-pass slowdown
    compute_scale: float = 1.0  # prefill clock under a power cap (1.0 = uncapped)
    worker_overhead_s: float = 0.0  # engine time per step per TP worker beyond the first
    layer_row_s: float = 0.0  # a Python engine's dispatch per layer and token row

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            lo, hi = FACTOR_BOUNDS[f.name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(f"{f.name} must be a number", field=f.name)
            if not math.isfinite(value) or not lo <= value <= hi:
                raise InvalidArgument(f"{f.name} must be in [{lo:g}, {hi:g}]", field=f.name)
        for name in ("gemm_eff", "bw_eff", "link_eff", "compute_scale"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0", field=name)

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

    def source_of(self, kind_name: str) -> str:
        """Which measured kind's factors ``for_kind`` returns, or "mean" for the prior."""
        if kind_name in self.per_kind:
            return kind_name
        alias = self.aliases.get(kind_name)
        if alias is not None and alias in self.per_kind:
            return alias
        return "fallback" if self.fallback is not None else "mean"


def mean_factors(items: tuple[KindFactors, ...]) -> KindFactors:
    """Geometric mean of each factor (uncapped): the prior for a GPU kind never measured."""
    if not items:
        raise InvalidArgument("no calibrated factors to average", field="per_kind")
    values = {}
    for f in fields(KindFactors):
        xs = [max(getattr(k, f.name), 1e-12) for k in items]
        values[f.name] = math.exp(sum(math.log(x) for x in xs) / len(xs))
    values["compute_scale"] = 1.0
    if any(k.long_pass_tokens == 0 for k in items):
        values["long_pass_tokens"] = values["long_pass_token_s"] = 0.0
    return KindFactors(**values)


# Fitted on all of /work/shared/reference/splitwise_perf_llama2_70b.csv (Llama-2-70B fp16 on
# DGX-A100, DGX-H100 and the power-capped DGX-H100 at TP 2, 4, 8; medians of ~5 repeats; the
# three TP-2 batch-64 configurations set aside as not holding their batch). Tested on: the
# same table in-sample, and by bench/perf_holdout.py on held-out TP and batch ranges with
# refits on the rest (docs/bench-perfmodel.md). Regenerate this block with
#   .venv/bin/python -m fleetshift_daemon.core.calibration \
#       ../shared/reference/splitwise_perf_llama2_70b.csv
SHIPPED_FACTORS: dict[str, KindFactors] = {
    "A100-SXM-80GB": KindFactors(
        gemm_eff=0.7436,
        bw_eff=0.8756,
        link_latency_s=1e-06,
        link_eff=0.6193,
        step_overhead_s=0.01511,
        seq_overhead_s=0.0001478,
        prefill_seq_overhead_s=0.01366,
        long_pass_token_s=0.0001063,
        long_pass_tokens=2048.0,
        worker_overhead_s=0.002513,
    ),
    "H100-SXM": KindFactors(
        gemm_eff=0.6455,
        bw_eff=0.991,
        link_latency_s=9.994e-07,
        link_eff=0.4665,
        step_overhead_s=0.01428,
        seq_overhead_s=0.0002275,
        prefill_seq_overhead_s=0.003256,
        long_pass_token_s=3.759e-05,
        long_pass_tokens=1536.0,
        worker_overhead_s=0.001199,
    ),
    "H100-SXM-PCAP70": KindFactors(
        gemm_eff=0.6455,
        bw_eff=0.991,
        link_latency_s=9.994e-07,
        link_eff=0.4665,
        step_overhead_s=0.01428,
        seq_overhead_s=0.0002275,
        prefill_seq_overhead_s=0.003256,
        long_pass_token_s=3.759e-05,
        long_pass_tokens=1536.0,
        compute_scale=0.7609,
        worker_overhead_s=0.001199,
    ),
}
# H200 is a Hopper GPU with H100's tensor cores, clocks, NVLink 4 and HGX host: it takes
# H100's factors, with its own (datasheet) HBM size and bandwidth. L40S is Ada: its tensor
# cores are programmed like Ampere's (no wgmma/TMA, which Hopper needs to reach its peak), so
# it takes A100's; its PCIe link was never measured, so its link factors are NVLink's.
SHIPPED_ALIASES: dict[str, str] = {"H200-SXM": "H100-SXM", "L40S": "A100-SXM-80GB"}


def shipped_factors() -> EfficiencyFactors:
    return EfficiencyFactors(per_kind=dict(SHIPPED_FACTORS), aliases=dict(SHIPPED_ALIASES))
