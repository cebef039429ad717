"""A roofline performance model of LLM inference, per GPU kind and phase.

Placement needs to compare GPU kinds the fleet has never run a given model on, so the model is
analytic: FLOPs and bytes come from the architecture, rates from the datasheet, and a few
factors that are properties of the hardware and the engine (``perf_factors``) close the gap to
measured times. Per step on a TP group of t GPUs:

- GEMMs: every matrix dimension (tokens M, and each weight's dims after TP sharding) is padded
  by ``TILE_PAD`` (tensor-core tiles), so a GEMM costs ``2 (M+s)(N+s)(K+s)`` FLOPs at
  ``gemm_eff`` x peak: efficiency is a function of the shapes, low for a decode step's few
  rows or a TP-8 shard's narrow matrices, near ``gemm_eff`` for a long prefill. FLOPs use the
  model's active parameters (a mixture of experts multiplies each token through its routed
  experts only); bytes use all of them.
- Attention: prefill's causal QK^T and AV as padded GEMMs per query head; a decode step reads
  the KV cache (``kv_cache_elems_per_token``, so MLA's latent counts as what it is) and runs
  one padded query row per sequence against its context.
- Communication: two all-reduces of the hidden state per layer, ring algorithm: latency per
  hop and bandwidth per link kind (NVLink within a node, else PCIe).
- Engine: a fixed time per step, and per step per TP worker beyond the first (the engine
  drives every worker each step; this, not per-layer link latency, is what grows a step's
  fixed time with TP on the measured stacks), per decode sequence and per prefill sequence;
  none scales with model size. A Python engine adds a dispatch time per layer and token row.
  A GPU engine runs prefill eagerly (decode replays a CUDA graph), so a prefill pass also
  launches every layer's kernels: a time per layer and prefill pass, spent on the host while
  the device runs what was launched before, so it bounds a pass from below (like the weights'
  streaming) rather than adding to the device's work.
- The measured stacks' slowdown of long passes is charged to the all-reduces: per token beyond
  the threshold, scaled by the bytes a ring moves per GPU (``ring_share``); none on one GPU.
- Engine shape (``EngineShape``, fixed per engine, not fitted): a GPU serving engine pads GEMM
  dimensions to tensor-core tiles and reads each sequence's KV prefix once per query tile; the
  reference engine on a CPU multiplies in fixed 16-row chunks (a decode step of 1 to 16
  sequences computes 16 rows of every GEMM and of the LM head), attends one query row at a
  time, so a prefill re-reads the KV prefix for every row (memory traffic that grows with the
  square of the prompt), and runs its Python on the core its matmuls use: its engine times
  are stated at an idle core and scale with the host's measured matmul rate.
- Prefill is compute-bound (weights stream under the GEMMs: the larger of the two counts); a
  decode step streams the weights once and adds each sequence's compute on top (small-batch
  decode does not overlap them).

Every time is ``a + b * x + ...`` in a few features of the batch, so ``coefficients()`` caches
those per deployment and routing/planning evaluate a time with a handful of multiplications.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.corrections import CorrectionTable, Phase
from fleetshift_daemon.core.errors import UnsupportedDeployment
from fleetshift_daemon.core.gpus import GpuKind
from fleetshift_daemon.core.perf_factors import (
    CalibrationKey,
    EfficiencyFactors,
    KindFactors,
    shipped_factors,
)

__all__ = [
    "Deployment",
    "Dtype",
    "ModelArch",
    "PerfCoefficients",
    "PerfModel",
    "Phase",
    "dtype_of_config",
    "llama2_70b",
]

EMBED_BYTES_PER_PARAM = 2  # embeddings and LM head stay BF16 under FP8 / INT4 weights
# Matrix dimensions are padded by this many rows/columns on average: tensor-core kernels work
# in tiles (16-256 wide), so a decode step's 1-64 rows, a head's 128 dims or a TP shard's
# narrow matrix cost more than their FLOPs. Fixed geometry, not fitted: with one model at
# three TP degrees a free padding is not identifiable apart from the GEMM efficiency.
TILE_PAD = 32.0


@dataclass(frozen=True)
class EngineShape:
    """What an engine's kernels look like, which sets how FLOPs and bytes become time.

    ``host_tflops``: where the engine's own times (per step, sequence, layer row) run on the
    same core as its matmuls (the reference engine on a CPU), the matmul rate those factors
    are stated at; a host whose measured rate is lower (another process holds part of the
    core) runs its Python as much slower as its matmuls. None: a GPU engine, whose host-side
    time does not slow with the device's rate.
    """

    tile_pad: float  # every GEMM dimension padded by this many on average
    kv_reread_per_row: bool  # prefill attention reads the KV prefix once per query row
    host_tflops: float | None = None
    row_chunk: int = 0  # every matmul runs on exactly this many rows (0: on the pass's rows)
    # The weights each chunk of rows multiplies, in the order the engine runs them: one group
    # is read whole before the next chunk reads it again (the reference engine: a layer's
    # QKV for every chunk, then its output projection and MLP for every chunk).
    weight_groups: tuple[tuple[str, ...], ...] = ()


# An idle core of the host the stored profiles ran on (an AMD EPYC, 2026-12-01): a float32
# 1024^3 matmul at 86 GFLOP/s on one thread (docs/bench-profile.md), in the FP32 convention of
# ``measurements.cpu_kind`` (the float32 rate doubled into ``bf16_tflops``). The reference
# engine's times (``PRIORS["layer_row_s"]`` among them) are stated at it.
IDLE_CPU_TFLOPS = 0.172
GPU_ENGINE = EngineShape(tile_pad=TILE_PAD, kv_reread_per_row=False)
# The reference engine multiplies every matrix in chunks of ``EngineConfig.rows`` = 16 rows
# (a token's numbers must not depend on its batch), the pass's rows padded to whole chunks:
# a decode step of 1 to 16 sequences computes 16 rows of every GEMM and of the LM head.
REFERENCE_ROW_CHUNK = 16
# ``engine.py``: per layer, ``pre`` (norm, Q/K/V) over every chunk, attention, then ``post``
# (output projection, norm, gate/up/down) over every chunk; names as ``_layer_gemms``'s.
REFERENCE_WEIGHT_GROUPS = (("qkv",), ("out", "up", "down"))
REFERENCE_CPU_ENGINE = EngineShape(
    tile_pad=0.0,
    kv_reread_per_row=True,
    host_tflops=IDLE_CPU_TFLOPS,
    row_chunk=REFERENCE_ROW_CHUNK,
    weight_groups=REFERENCE_WEIGHT_GROUPS,
)


def is_cpu_kind(name: str) -> bool:
    """``cpu``/``cpu-<model>``: a profile of the reference engine on a CPU, never a GPU kind."""
    return name.lower().startswith("cpu")


def engine_shape(gpu: GpuKind) -> EngineShape:
    """The reference engine on a CPU kind (``cpu``/``cpu-<model>``), else a GPU serving engine.

    A CPU kind is only ever a profile of the reference engine on this project's hosts, so the
    kind names the engine; a GPU kind is served by a batched-kernel engine (vLLM-like).
    """
    return REFERENCE_CPU_ENGINE if is_cpu_kind(gpu.name) else GPU_ENGINE


class Dtype(enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    INT4_W = "int4_w"  # INT4 weight-only: weights are 0.5 byte, compute runs at BF16
    FP32 = "fp32"  # e.g. the reference engine on a CPU: weights and KV 4 bytes, half BF16 rate

    @property
    def bytes_per_weight(self) -> float:
        return {Dtype.BF16: 2.0, Dtype.FP8: 1.0, Dtype.INT4_W: 0.5, Dtype.FP32: 4.0}[self]

    @property
    def kv_bytes_per_value(self) -> int:
        """KV cache kept in BF16 whatever the weight dtype, except a full-FP32 model's."""
        return 4 if self is Dtype.FP32 else 2


# config.json ``torch_dtype`` -> the dtype a model's weights, KV and matmuls run at. float16 is
# modelled as BF16: the same 2 bytes per value and, on every catalogued GPU, the same tensor
# peak. Absent: bfloat16, what Hugging Face checkpoints of the families served here ship in.
TORCH_DTYPES: dict[str, Dtype] = {
    "float16": Dtype.BF16,
    "bfloat16": Dtype.BF16,
    "float32": Dtype.FP32,
}


def dtype_of_config(raw: Mapping[str, object]) -> Dtype:
    """The dtype a Hugging Face ``config.json`` declares (``torch_dtype``, or ``dtype`` as
    newer transformers write it); one not in ``TORCH_DTYPES`` is refused, naming the key.

    Bytes per weight and per KV value follow it, so a float32 profile fitted as BF16 would
    read half the bytes it streams and put the difference into ``bw_eff``.
    """
    key = "torch_dtype" if "torch_dtype" in raw else "dtype"
    value = raw.get(key, "bfloat16")
    dtype = TORCH_DTYPES.get(value) if isinstance(value, str) else None
    if dtype is None:
        raise InvalidArgument(f"{key}: {value!r} is not one of {sorted(TORCH_DTYPES)}", field=key)
    return dtype


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
    trace (``CONTEXT_WINDOWS`` below), rope and norm cost nothing the model counts."""
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


# The named presets a daemon's model config (``preset = "…"``) and the simulator's fleets take,
# and each one's context window (its config's max_position_embeddings): ModelArch carries no
# window, so the daemon bounds Route's lengths and the simulator refuses longer requests by it.
PRESETS: dict[str, Callable[[], ModelArch]] = {"llama2-70b": llama2_70b, "llama31-70b": llama31_70b}
CONTEXT_WINDOWS: dict[str, int] = {"llama2-70b": 4096, "llama31-70b": 131_072}


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
                       + p_row * chunked(sum(L)) + p_head * chunked(len(lengths))
                       + p_stall * chunks(sum(L)) + p_head_stall * chunks(len(lengths)),
                       at least p_min
    decode(batch, ctx) = d0 + d_seq * batch + d_ctx * ctx + d_row * chunked(batch)
                         + d_stall * (chunks(batch) - 1)

    ``chunked(n)``: n rounded up to whole ``row_chunk``s, the rows an engine that multiplies in
    fixed chunks computes (the reference engine: its GEMMs on every row of the pass, its LM head
    on one row per sequence), ``chunks(n)`` how many chunks that is; 0 (GPU engines): no such
    terms, p_row = p_head = d_row = 0. ``p_stall``/``p_head_stall``: per chunk, the time its
    multiplies wait for weights that no longer fit the core's cache to stream in again from
    memory (``_chunk_stalls``); a decode step streams all weights once already (``d0``), so
    only its chunks after the first wait (``d_stall``).

    ``p_min`` is the roofline's floor: no pass is quicker than streaming the weights once, or
    than the host takes to launch an eager pass's kernels (the device works under both). It
    binds only for passes of a few dozen tokens, so the linear terms alone are close enough
    for a closed form (the planner's batch sizing) wherever a pass is worth sizing.
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
    p_min: float = 0.0
    row_chunk: int = 0
    p_row: float = 0.0
    p_head: float = 0.0
    d_row: float = 0.0
    p_stall: float = 0.0
    p_head_stall: float = 0.0
    d_stall: float = 0.0

    def chunks(self, rows: float) -> float:
        c = self.row_chunk
        return float(math.ceil(rows / c)) if c else 0.0

    def chunked(self, rows: float) -> float:
        return self.chunks(rows) * self.row_chunk

    def prefill_s(self, total_tokens: float, sum_sq: float, n_seqs: float) -> float:
        t = self.p0 + self.p_tok * total_tokens + self.p_sq * sum_sq + self.p_seq * n_seqs
        if total_tokens > self.knee_tokens:
            t += self.p_knee * (total_tokens - self.knee_tokens)
        t += self.p_row * self.chunked(total_tokens) + self.p_head * self.chunked(n_seqs)
        t += self.p_stall * self.chunks(total_tokens) + self.p_head_stall * self.chunks(n_seqs)
        return max(t, self.p_min)

    def decode_s(self, batch: float, context_tokens: float) -> float:
        t = self.d0 + self.d_seq * batch + self.d_ctx * context_tokens
        t += self.d_stall * max(0.0, self.chunks(batch) - 1)
        return t + self.d_row * self.chunked(batch)


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
    """All parameters (every expert of a mixture) at the weight dtype; embeddings and the
    LM head at BF16 under narrower weights (FP8, INT4), at the weights' own width otherwise:
    a float32 model's are float32, as the head's streaming stall already counts them."""
    arch = dep.arch
    other = arch.embedding_params + arch.hidden
    linear = arch.param_count() - other
    width = dep.dtype.bytes_per_weight
    return int(linear * width + other * max(width, EMBED_BYTES_PER_PARAM))


def _kv_bytes_per_token(dep: Deployment, physical: bool) -> int:
    """KV bytes one token caches; ``physical``: with KV heads replicated when tp > their count."""
    arch = dep.arch
    elems = arch.n_layers * arch.kv_cache_elems_per_token() * dep.dtype.kv_bytes_per_value
    if physical and dep.tp > arch.n_kv_heads:
        return elems * dep.tp // arch.n_kv_heads
    return elems


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


def _bf16_flops(dep: Deployment) -> float:
    """Peak of the attention matmuls, which run at the activations' precision."""
    peak = dep.gpu.bf16_tflops * 1e12
    return peak / 2 if dep.dtype is Dtype.FP32 else peak


def _peak_flops(dep: Deployment) -> float:
    if dep.dtype is Dtype.FP8:
        assert dep.gpu.fp8_tflops is not None
        return dep.gpu.fp8_tflops * 1e12
    return _bf16_flops(dep)


def _layer_gemms(arch: ModelArch, tp: int) -> list[tuple[float, float, float]]:
    """(N, K, unsharded N*K) of one layer's weight matrices on one GPU of the TP group.

    QKV and the MLP's up (and gate) projections are split by columns, the attention output
    and MLP down projections by rows (Megatron): TP narrows N of the first, K of the second.
    """
    qkv = (arch.n_heads + 2 * arch.n_kv_heads) * arch.head_dim
    up = (2 if arch.gated_mlp else 1) * arch.intermediate
    h, a, i = arch.hidden, arch.attn_dim, arch.intermediate
    return [
        (qkv / tp, h, qkv * h),
        (h, a / tp, h * a),
        (up / tp, h, up * h),
        (h, i / tp, h * i),
    ]


# ``_layer_gemms``'s matrices, in its order
LAYER_GEMM_NAMES = ("qkv", "out", "up", "down")


def _stream_stall(
    flops: float, nbytes: float, cache_bytes: float, rates: tuple[float, float]
) -> float:
    """Seconds a chunk's multiply of one weight group waits on memory beyond its compute.

    A group larger than the core's own cache was evicted since the last chunk read it (the
    chunks between read the layer's other groups, or other layers): it streams in again at the
    memory rate, under the multiply (hardware prefetch), so the chunk takes the longer of the
    two. A group that fits stays cached: no stall.
    """
    gemm_rate, mem_rate = rates
    if nbytes <= cache_bytes:
        return 0.0
    return max(0.0, nbytes / mem_rate - flops / gemm_rate)


def _chunk_stalls(
    dep: Deployment, shape: EngineShape, rates: tuple[float, float]
) -> tuple[float, float]:
    """(stall per chunk of a pass's rows over all layers, the LM head's per chunk of sampled
    rows) for an engine that multiplies in fixed row chunks; (0, 0) for any other."""
    c = shape.row_chunk
    if not c or not shape.weight_groups:
        return 0.0, 0.0
    arch, width = dep.arch, dep.dtype.bytes_per_weight
    cache = dep.gpu.core_cache_mb * 2**20
    dims = dict(zip(LAYER_GEMM_NAMES, _layer_gemms(arch, dep.tp), strict=True))
    layer = 0.0
    for group in shape.weight_groups:
        nk = sum(dims[name][0] * dims[name][1] for name in group)
        layer += _stream_stall(2 * c * nk, nk * width, cache, rates)
    head_nk = arch.hidden * arch.vocab / dep.tp
    head_bytes = head_nk * max(width, EMBED_BYTES_PER_PARAM)  # the weights' width, BF16 at least
    head = _stream_stall(2 * c * head_nk, head_bytes, cache, rates)
    return arch.n_layers * layer, head


def _padded_gemm_flops(arch: ModelArch, tp: int, s: float) -> tuple[float, float]:
    """Padded linear-layer FLOPs of a pass of M tokens on one GPU: ``a0 + a1 * M``.

    ``s``: the engine's tile padding. Scaled from the dense shapes to ``active_param_count()``:
    a mixture of experts multiplies each token through its routed experts only.
    """
    gemms = _layer_gemms(arch, tp)
    dense = arch.n_layers * sum(nk for _, _, nk in gemms)
    active = arch.active_param_count() - arch.embedding_params - arch.hidden
    per_token = arch.n_layers * sum(2 * (n + s) * (k + s) for n, k, _ in gemms)
    per_token *= active / dense
    return per_token * s, per_token


def _comm(dep: Deployment, kf: KindFactors) -> tuple[float, float]:
    """(latency per step, seconds per token) of the 2 all-reduces per layer (ring)."""
    tp = dep.tp
    if tp == 1:
        return 0.0, 0.0
    arch = dep.arch
    n_allreduce = 2 * arch.n_layers
    link = dep.gpu.interconnect_gbps * 1e9 / 2 * kf.link_eff  # one direction
    act_bytes = dep.dtype.kv_bytes_per_value  # activations travel at BF16 (FP32 on FP32)
    per_token = n_allreduce * 2 * (tp - 1) / tp * arch.hidden * act_bytes / link
    latency = n_allreduce * 2 * (tp - 1) * kf.link_latency_s
    return latency, per_token


def ring_share(tp: int) -> float:
    """Bytes a ring all-reduce moves over each GPU's link per byte reduced, relative to TP 2:
    ``2 (t-1) / t`` (1 at TP 2, 1.5 at 4, 1.75 at 8, 0 on one GPU, which reduces nothing).

    The long-pass slowdown (``KindFactors.long_pass_token_s``, stated at TP 2) scales with it:
    the slowdown is charged to the all-reduces of a pass whose activations outgrow what the
    link moves at full rate, so a pass with no all-reduce has none.
    """
    return 2.0 * (tp - 1) / tp


def _raw_coefficients(dep: Deployment, kf: KindFactors, reserve: float) -> PerfCoefficients:
    _validate(dep)
    arch, gpu, tp = dep.arch, dep.gpu, dep.tp
    shape = engine_shape(gpu)
    s = shape.tile_pad
    kv_cap = _kv_capacity(dep, reserve)
    gemm_rate = _peak_flops(dep) * kf.gemm_eff
    attn_rate = _bf16_flops(dep) * kf.gemm_eff
    mem_rate = gpu.hbm_tbps * 1e12 * tp * kf.bw_eff
    host = shape.host_tflops / gpu.bf16_tflops if shape.host_tflops else 1.0
    engine = (kf.step_overhead_s + kf.worker_overhead_s * (tp - 1)) * host
    rows = arch.n_layers * kf.layer_row_s * host  # per token row (a Python engine's loop)
    seq_s, prefill_seq_s = kf.seq_overhead_s * host, kf.prefill_seq_overhead_s * host
    latency, comm_tok = _comm(dep, kf)
    g0, g1 = (x / gemm_rate for x in _padded_gemm_flops(arch, tp, s))
    weights_s = _weight_bytes(dep) / mem_rate
    kv_s = _kv_bytes_per_token(dep, physical=True) / mem_rate  # one token's KV, all layers
    lm_head = 2 * (arch.hidden + s) * (arch.vocab / tp + s) / gemm_rate  # per sequence
    heads = arch.n_layers * arch.n_heads / tp * (arch.head_dim + s) / attn_rate
    # causal prefill attention of one sequence of L tokens: 2 (L+s)^2 (d+s) FLOPs per head
    # and layer, summed: 2 (sum L^2 + 2 s sum L + s^2 n); one row at a time, query i also
    # reads the i keys and values before it: sum L^2 / 2 tokens' KV
    # a decode step: 4 (1+s)(ctx+s)(d+s) per sequence, plus its KV read
    reread = kv_s / 2 if shape.kv_reread_per_row else 0.0
    slow = kf.compute_scale  # a power cap slows the whole prefill pass, not decode
    # an engine that multiplies in fixed row chunks computes its GEMMs (and, in decode, where
    # every row is sampled, the LM head) on the padded rows, not on the pass's tokens
    per_tok, per_row = (0.0, g1) if shape.row_chunk else (g1, 0.0)
    seq_head, row_head = (0.0, lm_head) if shape.row_chunk else (lm_head, 0.0)
    # prefill is not captured in a CUDA graph: the host launches every layer's kernels, but
    # asynchronously, ahead of the device, so a pass takes the longer of the launches and
    # the device's work, not their sum; only the weight-bound floor can be shorter than them
    eager = arch.n_layers * kf.prefill_layer_s
    stall, head_stall = _chunk_stalls(dep, shape, (gemm_rate, mem_rate))
    return PerfCoefficients(
        p0=(engine + latency + g0) / slow,
        p_tok=(per_tok + comm_tok + rows + 4 * s * heads) / slow,
        p_sq=(2 * heads + reread) / slow,
        p_seq=(seq_head + prefill_seq_s + 2 * s * s * heads) / slow,
        d0=engine + latency + weights_s,
        d_seq=per_tok + seq_head + comm_tok + rows + seq_s + 4 * (1 + s) * s * heads,
        d_ctx=kv_s + 4 * (1 + s) * heads,
        kv_capacity_tokens=kv_cap,
        kv_bytes_per_token=_kv_bytes_per_token(dep, physical=False),
        knee_tokens=kf.long_pass_tokens if kf.long_pass_token_s > 0 else math.inf,
        p_knee=kf.long_pass_token_s * ring_share(tp) / slow,
        p_min=(engine + latency + max(weights_s, eager)) / slow,
        row_chunk=shape.row_chunk,
        p_row=per_row / slow,
        p_head=row_head / slow,
        d_row=per_row + row_head,
        p_stall=stall / slow,
        p_head_stall=head_stall / slow,
        d_stall=stall + head_stall,
    )


class PerfModel:
    """Predicted prefill and decode-step times of a deployment, corrected online.

    ``factors`` are per GPU kind and transferable: hardware properties that hold for any model.
    ``calibrations`` are factors fitted on one model's measurements on one GPU kind, keyed by
    (model name, GPU kind name); where one exists it takes precedence, because a profile of the
    model itself beats a transfer from another model.
    """

    def __init__(
        self,
        factors: EfficiencyFactors | None = None,
        corrections: CorrectionTable | None = None,
        calibrations: Mapping[CalibrationKey, KindFactors] | None = None,
    ) -> None:
        self.factors = factors or shipped_factors()
        self.corrections = corrections
        self.calibrations: Mapping[CalibrationKey, KindFactors] = dict(calibrations or {})
        self._coeff = functools.lru_cache(maxsize=4096)(self._coefficients_uncached)

    def factors_for(self, dep: Deployment) -> KindFactors:
        """The deployment's own calibration if it has one, else its GPU kind's factors."""
        own = self.calibrations.get((dep.arch.name, dep.gpu.name))
        return own if own is not None else self.factors.for_kind(dep.gpu.name)

    def is_measured(self, dep: Deployment) -> bool:
        """True when this (model, GPU kind) was fitted on measurements of that model there.

        False means its times are predicted from hardware figures and transferable factors.
        """
        return (dep.arch.name, dep.gpu.name) in self.calibrations

    def _coefficients_uncached(self, dep: Deployment, reserve: float) -> PerfCoefficients:
        return _raw_coefficients(dep, self.factors_for(dep), reserve)

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
