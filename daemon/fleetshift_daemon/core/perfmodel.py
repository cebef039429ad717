"""A roofline performance model of LLM inference, per GPU kind and phase.

Placement needs to compare GPU kinds the fleet has never run a given model on, so the model is
analytic: FLOPs and bytes come from the architecture, rates from the datasheet, and a few
fitted efficiency factors (``perf_factors``) close the gap to measured times.

- Prefill is compute-bound: dense GEMM FLOPs (2 x params x tokens) plus attention's quadratic
  term over the TP group's dense peak, plus streaming the weights once, plus two all-reduces
  per layer over the TP interconnect, plus a fixed overhead.
- A decode step is bound by memory bandwidth: weights/TP plus the KV cache read, over HBM
  bandwidth, plus the batch's compute, plus the same all-reduces (latency-dominated) and a
  fixed overhead. Both terms are summed, not maxed: small-batch decode does not overlap them.

Every time is ``a + b * x + ...`` in a few features of the batch, so ``coefficients()`` caches
those per deployment and routing/planning evaluate a time with a handful of multiplications.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.corrections import CorrectionTable, Phase
from fleetshift_daemon.core.errors import InvalidModelArch, UnsupportedDeployment
from fleetshift_daemon.core.gpus import GpuKind
from fleetshift_daemon.core.perf_factors import EfficiencyFactors, KindFactors, shipped_factors

__all__ = [
    "Deployment",
    "Dtype",
    "ModelArch",
    "PerfCoefficients",
    "PerfModel",
    "Phase",
    "llama2_70b",
]

KV_BYTES_PER_VALUE = 2  # KV cache kept in BF16 whatever the weight dtype
EMBED_BYTES_PER_PARAM = 2  # embeddings and LM head stay BF16 under FP8 / INT4 weights


class Dtype(enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    INT4_W = "int4_w"  # INT4 weight-only: weights are 0.5 byte, compute runs at BF16

    @property
    def bytes_per_weight(self) -> float:
        return {Dtype.BF16: 2.0, Dtype.FP8: 1.0, Dtype.INT4_W: 0.5}[self]


@dataclass(frozen=True)
class ModelArch:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int
    gated_mlp: bool = True  # SwiGLU (Llama/Mistral/Qwen): 3 MLP matrices; GPT-NeoX: 2
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        ints = ("n_layers", "hidden", "n_heads", "n_kv_heads", "intermediate", "vocab", "head_dim")
        for f in ints:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidModelArch(f"{f} must be a positive integer, got {value!r}", field=f)
        if self.n_heads % self.n_kv_heads:
            raise InvalidModelArch(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
                field="n_kv_heads",
            )

    @classmethod
    def from_hf_config(cls, name: str, cfg: Mapping[str, Any]) -> ModelArch:
        """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, GPT-NeoX key names)."""

        def pick(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if k in cfg and cfg[k] is not None:
                    return cfg[k]
            if default is None:
                raise InvalidModelArch(f"config lacks {keys[0]}", field=keys[0])
            return default

        hidden = pick("hidden_size", "n_embd", "d_model")
        n_heads = pick("num_attention_heads", "n_head")
        for key, value in (("hidden_size", hidden), ("num_attention_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidModelArch(f"{key} must be a positive integer", field=key)
        model_type = str(cfg.get("model_type", ""))
        act = str(cfg.get("hidden_act", cfg.get("activation_function", "silu")))
        gated = model_type not in ("gpt_neox", "gpt2", "gptj") and "gelu" not in act
        return cls(
            name=name,
            n_layers=pick("num_hidden_layers", "n_layer", "num_layers"),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=pick("num_key_value_heads", "num_kv_heads", default=n_heads),
            intermediate=pick("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
            vocab=pick("vocab_size"),
            head_dim=pick("head_dim", default=hidden // n_heads if hidden % n_heads == 0 else -1),
            gated_mlp=gated,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def attn_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        kv = self.n_kv_heads * self.head_dim
        attn = self.hidden * self.attn_dim * 2 + self.hidden * kv * 2
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden  # + two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def param_count(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.hidden


def llama2_70b() -> ModelArch:
    return ModelArch(
        name="llama2-70b",
        n_layers=80,
        hidden=8192,
        n_heads=64,
        n_kv_heads=8,
        intermediate=28672,
        vocab=32000,
        head_dim=128,
    )


def llama31_70b() -> ModelArch:
    """Llama-3.1-70B: Llama-2-70B's shape (80 layers, 8192 hidden, 64 heads, 8 KV heads,
    28672 MLP) with a 128,256-token vocabulary. Its config's other values (a 131,072-token
    window, ``max_position_embeddings``; rope theta 500,000 with llama3 scaling factor 8; RMS
    norm eps 1e-5; untied embeddings) change no step time here: the window is enforced on the
    trace (``sim.fleet.CONTEXT_WINDOWS``), rope and norm cost nothing the model counts."""
    return ModelArch(
        name="llama31-70b",
        n_layers=80,
        hidden=8192,
        n_heads=64,
        n_kv_heads=8,
        intermediate=28672,
        vocab=128256,
        head_dim=128,
    )


@dataclass(frozen=True)
class Deployment:
    arch: ModelArch
    gpu: GpuKind
    tp: int
    dtype: Dtype = Dtype.BF16


@dataclass(frozen=True)
class PerfCoefficients:
    """Times as linear functions of batch features (seconds), corrections not applied.

    prefill(lengths) = p0 + p_tok * sum(L) + p_sq * sum(L^2) + p_seq * len(lengths)
                       + p_knee * max(0, sum(L) - knee_tokens)
    decode(batch, ctx) = d0 + d_seq * batch + d_ctx * ctx
    """

    p0: float
    p_tok: float
    p_sq: float
    p_seq: float
    d0: float
    d_seq: float
    d_ctx: float
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    knee_tokens: float = math.inf
    p_knee: float = 0.0

    def prefill_s(self, total_tokens: float, sum_sq: float, n_seqs: float) -> float:
        t = self.p0 + self.p_tok * total_tokens + self.p_sq * sum_sq + self.p_seq * n_seqs
        if total_tokens > self.knee_tokens:
            t += self.p_knee * (total_tokens - self.knee_tokens)
        return t

    def decode_s(self, batch: float, context_tokens: float) -> float:
        return self.d0 + self.d_seq * batch + self.d_ctx * context_tokens


def _validate(dep: Deployment) -> None:
    arch = dep.arch
    if isinstance(dep.tp, bool) or not isinstance(dep.tp, int) or dep.tp <= 0:
        raise UnsupportedDeployment(f"tp must be a positive integer, got {dep.tp!r}", field="tp")
    if arch.n_heads % dep.tp:
        raise UnsupportedDeployment(
            f"tp={dep.tp} does not divide {arch.name}'s {arch.n_heads} attention heads",
            field="tp",
        )
    if arch.n_kv_heads % dep.tp and dep.tp % arch.n_kv_heads:
        raise UnsupportedDeployment(
            f"tp={dep.tp} and {arch.name}'s {arch.n_kv_heads} KV heads do not divide each other",
            field="tp",
        )
    if dep.dtype is Dtype.FP8 and not dep.gpu.supports_fp8:
        raise UnsupportedDeployment(f"{dep.gpu.name} has no FP8 tensor cores", field="dtype")


def _weight_bytes(dep: Deployment) -> int:
    arch = dep.arch
    linear = arch.n_layers * arch.layer_params
    other = arch.param_count() - linear
    return int(linear * dep.dtype.bytes_per_weight + other * EMBED_BYTES_PER_PARAM)


def _kv_bytes_per_token(dep: Deployment, physical: bool) -> int:
    arch = dep.arch
    heads = max(arch.n_kv_heads, dep.tp) if physical else arch.n_kv_heads
    return 2 * arch.n_layers * heads * arch.head_dim * KV_BYTES_PER_VALUE


def _kv_capacity(dep: Deployment, reserve_fraction: float) -> int:
    usable = dep.gpu.hbm_bytes * dep.tp * (1.0 - reserve_fraction)
    free = usable - _weight_bytes(dep)
    if free <= 0:
        raise UnsupportedDeployment(
            f"{dep.arch.name} ({dep.dtype.value}, {_weight_bytes(dep) / 2**30:.1f} GiB) does not "
            f"fit on {dep.tp} x {dep.gpu.name} ({dep.gpu.hbm_gb:g} GB each)",
            field="tp",
        )
    return int(free // _kv_bytes_per_token(dep, physical=True))


def _peak_flops(dep: Deployment) -> float:
    if dep.dtype is Dtype.FP8:
        assert dep.gpu.fp8_tflops is not None
        return dep.gpu.fp8_tflops * 1e12
    return dep.gpu.bf16_tflops * 1e12


def _raw_coefficients(dep: Deployment, kf: KindFactors, reserve: float) -> PerfCoefficients:
    _validate(dep)
    arch, gpu, tp = dep.arch, dep.gpu, dep.tp
    kv_cap = _kv_capacity(dep, reserve)
    compute_rate = (
        _peak_flops(dep) * tp * kf.compute_eff * kf.compute_scale * tp ** (-kf.tp_scaling)
    )
    mem_rate = gpu.hbm_tbps * 1e12 * tp * kf.bw_eff
    # An all-reduce of n bytes per GPU: latency per log2(TP) step + ring traffic 2(t-1)/t * n
    # over one direction of the link (half the bidirectional figure).
    n_allreduce = 2 * arch.n_layers
    steps = math.ceil(math.log2(tp)) if tp > 1 else 0
    link = gpu.interconnect_gbps * 1e9 / 2 * kf.comm_eff
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    comm_per_token = n_allreduce * ring * arch.hidden * 2 / link
    comm_fixed = n_allreduce * steps * kf.allreduce_latency_s
    gemm_flops_per_token = 2 * arch.n_layers * arch.layer_params
    lm_head_flops = 2 * arch.hidden * arch.vocab
    weights_s = _weight_bytes(dep) / mem_rate
    kv_read_s_per_token = _kv_bytes_per_token(dep, physical=True) / mem_rate
    attn_flops_per_ctx = 4 * arch.n_layers * arch.attn_dim  # QK^T and AV for one new token
    return PerfCoefficients(
        p0=kf.prefill_overhead_s + weights_s + comm_fixed,
        p_tok=gemm_flops_per_token / compute_rate + comm_per_token,
        # causal attention over L tokens: 2 * L^2 * attn_dim FLOPs per layer
        p_sq=2 * arch.n_layers * arch.attn_dim / compute_rate,
        p_seq=lm_head_flops / compute_rate,
        d0=kf.decode_overhead_s + weights_s + comm_fixed,
        d_seq=(gemm_flops_per_token + lm_head_flops) / compute_rate + comm_per_token,
        d_ctx=kv_read_s_per_token + attn_flops_per_ctx / compute_rate,
        kv_capacity_tokens=kv_cap,
        kv_bytes_per_token=_kv_bytes_per_token(dep, physical=False),
        knee_tokens=kf.knee_tokens if kf.knee_slowdown > 0 else math.inf,
        p_knee=kf.knee_slowdown * gemm_flops_per_token / compute_rate,
    )


class PerfModel:
    """Predicted prefill and decode-step times of a deployment, corrected online."""

    def __init__(
        self,
        factors: EfficiencyFactors | None = None,
        corrections: CorrectionTable | None = None,
    ) -> None:
        self.factors = factors or shipped_factors()
        self.corrections = corrections
        self._coeff = functools.lru_cache(maxsize=4096)(self._coefficients_uncached)

    def _coefficients_uncached(self, dep: Deployment, reserve: float) -> PerfCoefficients:
        return _raw_coefficients(dep, self.factors.for_kind(dep.gpu.name), reserve)

    def coefficients(self, dep: Deployment, reserve_fraction: float = 0.1) -> PerfCoefficients:
        """Cached per deployment; raises ``UnsupportedDeployment`` for what cannot run."""
        return self._coeff(dep, reserve_fraction)

    def correction(self, dep: Deployment, phase: Phase) -> float:
        if self.corrections is None:
            return 1.0
        return self.corrections.factor(dep.gpu.name, phase)

    def prefill_time_s(self, dep: Deployment, prompt_lengths: Sequence[int]) -> float:
        if not prompt_lengths or any(n <= 0 for n in prompt_lengths):
            raise InvalidArgument(
                "prompt_lengths must be non-empty and positive", field="prompt_lengths"
            )
        c = self.coefficients(dep)
        total = float(sum(prompt_lengths))
        sq = float(sum(n * n for n in prompt_lengths))
        return c.prefill_s(total, sq, len(prompt_lengths)) * self.correction(dep, Phase.PREFILL)

    def decode_step_time_s(self, dep: Deployment, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            raise InvalidArgument("batch_size must be > 0", field="batch_size")
        if context_tokens < 0:
            raise InvalidArgument("context_tokens must be >= 0", field="context_tokens")
        c = self.coefficients(dep)
        return c.decode_s(batch_size, context_tokens) * self.correction(dep, Phase.DECODE)

    def record_prefill(
        self, dep: Deployment, prompt_lengths: Sequence[int], observed_s: float
    ) -> float:
        """A worker's measured prefill pass, folded into the online correction; new factor."""
        c = self.coefficients(dep)
        predicted = c.prefill_s(
            float(sum(prompt_lengths)),
            float(sum(n * n for n in prompt_lengths)),
            len(prompt_lengths),
        )
        return self._record(dep, Phase.PREFILL, observed_s, predicted)

    def record_decode_step(
        self, dep: Deployment, batch_size: int, context_tokens: int, observed_s: float
    ) -> float:
        """A worker's measured decode step (e.g. mean TBT at its mean batch); new factor."""
        predicted = self.coefficients(dep).decode_s(batch_size, context_tokens)
        return self._record(dep, Phase.DECODE, observed_s, predicted)

    def _record(self, dep: Deployment, phase: Phase, observed_s: float, predicted: float) -> float:
        if self.corrections is None:
            raise InvalidArgument("this model keeps no correction table", field="corrections")
        return self.corrections.observe(dep.gpu.name, phase, observed_s, predicted)

    def kv_bytes_per_token(self, dep: Deployment) -> int:
        _validate(dep)
        return _kv_bytes_per_token(dep, physical=False)

    def kv_capacity_tokens(self, dep: Deployment, reserve_fraction: float = 0.1) -> int:
        if not 0.0 <= reserve_fraction < 1.0:
            raise InvalidArgument("reserve_fraction must be in [0, 1)", field="reserve_fraction")
        _validate(dep)
        return _kv_capacity(dep, reserve_fraction)

    def weight_bytes(self, dep: Deployment) -> int:
        _validate(dep)
        return _weight_bytes(dep)

    def fits(self, dep: Deployment, reserve_fraction: float = 0.1) -> bool:
        try:
            self.kv_capacity_tokens(dep, reserve_fraction)
        except UnsupportedDeployment:
            return False
        return True
