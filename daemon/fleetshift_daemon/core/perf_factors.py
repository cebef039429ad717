"""The factors that turn datasheet figures into measured step times, each a physical quantity.

A GPU never reaches its datasheet peak, and a serving stack adds time of its own. Rather than
tabulate times, the model keeps a handful of factors per GPU kind, fitted on measurements
(``calibration.py``), so that it extrapolates to models, batch shapes and GPU kinds that were
never measured. Each factor is a property of the hardware or of the engine, not of one model:

- how close GEMMs come to the dense tensor peak (``gemm_eff``; the shape dependence, tile
  padding of every matrix dimension, is geometry: ``perfmodel.TILE_PAD``), and HBM streaming
  to its bandwidth (``bw_eff``);
- per all-reduce over the TP group's link (NVLink in a node): a latency per ring hop (fixed
  from a microbenchmark, ``FIXED_FACTORS``) and the fraction of the link's one-direction
  bandwidth reached;
- the engine's fixed time per step (scheduling, launches), per step and per TP worker beyond
  the first (the engine drives t processes every step: inputs broadcast, results gathered),
  per sequence in a decode step (sampling, bookkeeping) and per sequence in a prefill pass;
  none scales with model size;
- ``layer_row_s``: a Python engine's dispatch per layer and token row (the reference engine
  calls attention once per query row and layer; a GPU serving engine batches it, so 0 there);
  on a CPU kind this and the other engine times are stated at an idle core
  (``perfmodel.EngineShape.host_tflops``);
- ``prefill_layer_s``: a GPU serving engine's eager kernel launches per layer and prefill pass
  (decode steps replay a CUDA graph; 0 on the reference engine, whose phases run alike); the
  host launches while the device works, so it is a floor under a pass, not an addition;
- the measured stacks' slowdown once one prefill pass holds more than ``long_pass_tokens``
  tokens (Splitwise: from 2-4k tokens on, on every kind and TP), as seconds per token beyond
  at TP 2, charged to the all-reduces (``perfmodel.ring_share``: x1.5 at TP 4, 0 on one GPU);
- ``compute_scale``: the clock a power cap leaves in power-hungry prefill passes (1 = none).

Every factor has physical bounds (``FACTOR_BOUNDS``); a fit that ends on one is reported.
Some factors are not identifiable from one model's profile (a Python engine's per-layer
dispatch from its per-token compute), so the fit carries a prior for them (``PRIORS``): a
centre taken from microbenchmarks and datasheets, not from the fitted table, and a width; the
data move a factor as far as they can tell it apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING as MISSING_DEFAULT
from dataclasses import dataclass, field, fields, replace
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
    "prefill_layer_s": (0.0, 1e-3),
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
    "prefill_seq_overhead_s": (1e-3, 1.5),
    "layer_row_s": (7.5e-5, 1.5),
}


# Factors no profile fits, set from a microbenchmark of the link alone: an NCCL LL-protocol
# ring step over NVLink is ~1 us. Fitted with a prior (issue 12's second round) it never left
# the prior's centre on any subset of the reference table: one model at TP 2-8 cannot tell a
# per-hop latency from the engine's per-worker time, so a free factor here only looked fitted.
FIXED_FACTORS: dict[str, float] = {"link_latency_s": 1e-6}


@dataclass(frozen=True)
class KindFactors:
    gemm_eff: float  # fraction of dense tensor peak reached by large (unpadded) GEMMs
    bw_eff: float  # fraction of HBM bandwidth reached streaming weights and KV
    link_latency_s: float  # per ring hop of an all-reduce (2 (t-1) hops each)
    link_eff: float  # fraction of one-direction link bandwidth an all-reduce reaches
    step_overhead_s: float  # engine time per step (prefill pass or decode step), any model
    seq_overhead_s: float  # engine time per sequence in a decode step
    prefill_seq_overhead_s: float = 0.0  # engine time per sequence in a prefill pass
    long_pass_token_s: float = 0.0  # extra s per token beyond long_pass_tokens, at TP 2
    long_pass_tokens: float = 0.0  # 0: no long-pass slowdown
    compute_scale: float = 1.0  # prefill clock under a power cap (1.0 = uncapped)
    worker_overhead_s: float = 0.0  # engine time per step per TP worker beyond the first
    layer_row_s: float = 0.0  # a Python engine's dispatch per layer and token row
    prefill_layer_s: float = 0.0  # a GPU engine's eager kernel launches per layer and prefill

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
        gemm_eff=0.7176,
        bw_eff=0.8652,
        link_latency_s=1e-06,
        link_eff=0.6917,
        step_overhead_s=0.01459,
        seq_overhead_s=0.0001451,
        prefill_seq_overhead_s=0.01326,
        long_pass_token_s=6.347e-05,
        long_pass_tokens=2048.0,
        worker_overhead_s=0.002574,
        prefill_layer_s=0.0002534,
    ),
    "H100-SXM": KindFactors(
        gemm_eff=0.5952,
        bw_eff=0.9392,
        link_latency_s=1e-06,
        link_eff=0.4828,
        step_overhead_s=0.01313,
        seq_overhead_s=0.000226,
        prefill_seq_overhead_s=0.0002715,
        long_pass_token_s=2.578e-05,
        long_pass_tokens=1536.0,
        worker_overhead_s=0.001316,
        prefill_layer_s=0.0003994,
    ),
}
SHIPPED_FACTORS["H100-SXM-PCAP70"] = replace(SHIPPED_FACTORS["H100-SXM"], compute_scale=0.7692)
# H200 is a Hopper GPU with H100's tensor cores, clocks, NVLink 4 and HGX host: it takes
# H100's factors, with its own (datasheet) HBM size and bandwidth. L40S is Ada: its tensor
# cores are programmed like Ampere's (no wgmma/TMA, which Hopper needs to reach its peak), so
# it takes A100's; its PCIe link was never measured, so its link factors are NVLink's.
SHIPPED_ALIASES: dict[str, str] = {"H200-SXM": "H100-SXM", "L40S": "A100-SXM-80GB"}


def shipped_factors() -> EfficiencyFactors:
    return EfficiencyFactors(per_kind=dict(SHIPPED_FACTORS), aliases=dict(SHIPPED_ALIASES))
