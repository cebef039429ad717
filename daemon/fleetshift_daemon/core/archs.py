"""What the performance model needs to know of a model's architecture: its shapes and sizes.

Kept apart from the performance model so that reading a Hugging Face ``config.json`` and
counting parameters, which every planner and simulator input goes through, can grow per model
family without touching the timing model.

The dataclass describes a decoder-only transformer closely enough to count its parameters
exactly as the family's ``transformers`` implementation builds them: the attention (standard
multi-/grouped-query, or DeepSeek's multi-head latent attention), the MLP (gated or not, dense
or a mixture of experts), biases, norms and embeddings. The defaults describe a Llama, so the
positional constructor the planner, benchmarks and tests use keeps meaning what it meant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetshift_daemon.core.errors import InvalidModelArch

__all__ = ["MlaSpec", "ModelArch", "MoeSpec"]


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InvalidModelArch(f"{owner}{name} must be {rule}, got {value!r}", field=name)


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP: the layers that have one route each token to a few experts.

    Every expert is a gated (SwiGLU) MLP of width ``expert_intermediate``, as in Mixtral,
    Qwen2-MoE and DeepSeek. The shared expert(s), which every token passes through, are counted
    as one gated MLP of width ``shared_intermediate`` (DeepSeek's ``n_shared_experts`` experts
    are built as exactly that). Layers that are not MoE layers use the dense ``intermediate``.
    """

    n_experts: int  # routed experts per MoE layer
    experts_per_token: int  # top-k routed experts each token is sent to
    expert_intermediate: int  # width of one routed expert
    n_moe_layers: int  # how many decoder layers have this MLP; the others are dense
    n_shared_experts: int = 0  # always-on experts (DeepSeek 1-2, Qwen2-MoE 1, Mixtral 0)
    shared_intermediate: int = 0  # total width of the shared experts' MLP
    shared_expert_gate: bool = False  # Qwen2-MoE scales the shared expert by a learned gate

    def __post_init__(self) -> None:
        for name in ("n_experts", "experts_per_token", "expert_intermediate"):
            _check_int("moe.", name, getattr(self, name), 1)
        for name in ("n_moe_layers", "n_shared_experts", "shared_intermediate"):
            _check_int("moe.", name, getattr(self, name), 0)
        if self.experts_per_token > self.n_experts:
            raise InvalidModelArch(
                f"experts_per_token ({self.experts_per_token}) exceeds the "
                f"{self.n_experts} routed experts",
                field="experts_per_token",
            )
        if (self.n_shared_experts == 0) != (self.shared_intermediate == 0):
            raise InvalidModelArch(
                "shared experts need a width and a width needs shared experts",
                field="shared_intermediate",
            )


@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek's multi-head latent attention (DeepSeek-V2 paper, section 2.1).

    Keys and values are compressed into one ``kv_lora_rank`` latent per token plus a shared
    rotary key of ``qk_rope_head_dim``; that pair is all an MLA-aware engine (vLLM, SGLang)
    caches, which is why its KV cache is a fraction of an equal-sized MHA model's. Queries may
    be compressed too (``q_lora_rank``; 0 means projected directly, as in DeepSeek-V2-Lite).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        _check_int("mla.", "q_lora_rank", self.q_lora_rank, 0)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_int("mla.", name, getattr(self, name), 1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer's shapes; ``from_hf_config`` reads one from ``config.json``.

    For MLA models ``head_dim`` is the query/key head width (nope + rope) and ``n_kv_heads``
    equals ``n_heads``: that is what attention computes over once the latent is expanded.
    """

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    intermediate: int  # dense MLP width (for an all-MoE model, the expert width)
    vocab: int
    head_dim: int
    gated_mlp: bool = True  # SwiGLU (Llama/Mistral/Qwen): 3 MLP matrices; GPT-NeoX: 2
    tied_embeddings: bool = False
    # The config's model_type ("" when built by hand): where the shapes came from, not a shape,
    # so two archs with equal shapes compare (and cache) equal whatever they were read from.
    family: str = field(default="", compare=False)
    qkv_bias: bool = False  # biases on the Q, K, V projections (Qwen2, GPT-2, BLOOM ...)
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # biases on the MLP projections
    lm_head_bias: bool = False  # GPT-J and Phi's LM head has a bias
    norm_vectors: int = 1  # per norm and hidden unit: RMSNorm 1, LayerNorm 2, non-affine 0
    norms_per_layer: int = 2  # 1 where attention and MLP share one input norm (GPT-J, Phi)
    final_norm: bool = True
    qk_norm: bool = False  # a norm over each query and key head (Phi's qk_layernorm)
    embedding_norm: bool = False  # BLOOM normalises the embeddings before the first layer
    learned_positions: int = 0  # rows of a learned position table (GPT-2, OPT); 0: RoPE/ALiBi
    alibi: bool = False  # positions as attention biases (BLOOM): no table, no rotary
    parallel_attn: bool = False  # attention and MLP read the same input (GPT-J, NeoX, Falcon)
    embed_dim: int = 0  # OPT's word_embed_proj_dim where it differs from hidden; 0: hidden
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None

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
        for name, low in (("norm_vectors", 0), ("norms_per_layer", 0), ("learned_positions", 0)):
            _check_int("", name, getattr(self, name), low)
        _check_int("", "embed_dim", self.embed_dim, 0)
        if self.mla is not None and (self.head_dim, self.n_kv_heads) != (
            self.mla.qk_head_dim,
            self.n_heads,
        ):
            raise InvalidModelArch(
                "with MLA, head_dim is qk_nope_head_dim + qk_rope_head_dim "
                f"({self.mla.qk_head_dim}) and every head is a KV head ({self.n_heads})",
                field="head_dim",
            )
        if self.moe is not None and self.moe.n_moe_layers > self.n_layers:
            raise InvalidModelArch(
                f"{self.moe.n_moe_layers} MoE layers in a {self.n_layers}-layer model",
                field="n_moe_layers",
            )

    @classmethod
    def from_hf_config(cls, name: str, cfg: Mapping[str, Any]) -> ModelArch:
        """Read a Hugging Face ``config.json`` of a family ``hf_config`` knows, never guessing.

        Imported here rather than at the top because the readers build ``ModelArch`` values.
        """
        from fleetshift_daemon.core.hf_config import read_hf_config

        return read_hf_config(name, cfg)

    @property
    def attn_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def attention_params(self) -> int:
        """One layer's attention projections (and their biases and per-head norms)."""
        if self.mla is not None:
            return self._mla_params(self.mla)
        weights = self.hidden * self.attn_dim * 2 + self.hidden * self.kv_dim * 2
        biases = (self.attn_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (
            self.hidden if self.o_bias else 0
        )
        qk_norms = 2 * self.head_dim * self.norm_vectors if self.qk_norm else 0
        return weights + biases + qk_norms

    def _mla_params(self, mla: MlaSpec) -> int:
        # Projections as DeepSeek builds them: q_a (+ norm) and q_b, or a direct q_proj;
        # kv_a_proj_with_mqa to the latent plus rope key, its norm, kv_b up to K_nope and V;
        # o_proj. attention_bias puts biases on q_a, kv_a and o (the only ones with a flag).
        q_out = self.n_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            q = self.hidden * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * q_out
            q += mla.q_lora_rank if self.qkv_bias else 0
        else:
            q = self.hidden * q_out
        kv_a_out = mla.kv_lora_rank + mla.qk_rope_head_dim
        kv = self.hidden * kv_a_out + mla.kv_lora_rank  # + the latent's RMSNorm
        kv += mla.kv_lora_rank * self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        kv += kv_a_out if self.qkv_bias else 0
        o = self.n_heads * mla.v_head_dim * self.hidden + (self.hidden if self.o_bias else 0)
        return q + kv + o

    def dense_mlp_params(self) -> int:
        matrices = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        bias = ((2 if self.gated_mlp else 1) * self.intermediate + self.hidden) * self.mlp_bias
        return matrices + bias

    def moe_mlp_params(self, active: bool = False) -> int:
        """One MoE layer's MLP: router, routed experts (all, or the top-k), shared experts."""
        moe = self.moe
        if moe is None:
            return 0
        experts = moe.experts_per_token if active else moe.n_experts
        routed = experts * 3 * self.hidden * moe.expert_intermediate
        shared = 3 * self.hidden * moe.shared_intermediate
        gates = self.hidden * moe.n_experts + (self.hidden if moe.shared_expert_gate else 0)
        return routed + shared + gates

    def decoder_param_count(self, active: bool = False) -> int:
        """All decoder layers: what the linear-layer weight bytes (all experts) come from.

        ``active=True`` counts each MoE layer's router, shared and top-k experts only: the
        parameters one token is multiplied through, which set a forward pass's GEMM FLOPs.
        """
        norms = self.norms_per_layer * self.hidden * self.norm_vectors
        n_moe = self.moe.n_moe_layers if self.moe is not None else 0
        per_layer = self.attention_params() + norms
        return (
            self.n_layers * per_layer
            + (self.n_layers - n_moe) * self.dense_mlp_params()
            + n_moe * self.moe_mlp_params(active)
        )

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters; where layers differ (MoE), their mean (all experts)."""
        return self.decoder_param_count() // self.n_layers

    @property
    def embedding_params(self) -> int:
        """Token embeddings, the LM head unless tied, and a learned position table."""
        width = self.embed_dim or self.hidden
        tokens = self.vocab * width * (1 if self.tied_embeddings else 2)
        return tokens + self.learned_positions * self.hidden

    def _other_params(self) -> int:
        """Final and embedding norms, the LM head's bias, OPT's embedding projections."""
        norm = self.hidden * self.norm_vectors
        projections = 2 * self.hidden * self.embed_dim if self.embed_dim else 0
        return (
            norm * self.final_norm
            + norm * self.embedding_norm
            + (self.vocab if self.lm_head_bias else 0)
            + projections
        )

    def param_count(self) -> int:
        """Every parameter, all experts included: what the weights occupy in memory."""
        return self.decoder_param_count() + self.embedding_params + self._other_params()

    def active_param_count(self) -> int:
        """Parameters each token touches: ``param_count()`` less the experts it is not sent to.

        A dense model touches every parameter, so this equals ``param_count()``; a mixture of
        experts touches only its router, shared and top-k routed experts. Both embedding tables
        are included, as in the published active figures of Mixtral (12.9B) and Qwen1.5-MoE
        (2.7B); ``forward_param_count()`` leaves out the lookups, for FLOPs.
        """
        return self.decoder_param_count(active=True) + self.embedding_params + self._other_params()

    def forward_param_count(self) -> int:
        """The active parameters a token is multiplied by: less the tables it only looks up.

        That is the active count without the input embedding table (when not tied to the LM
        head) and a learned position table; ``2 *`` this is a token's forward GEMM FLOPs.
        DeepSeek's published "activated parameters" (V2 21B, V3 37B) match this figure.
        """
        width = self.embed_dim or self.hidden
        lookups = (0 if self.tied_embeddings else self.vocab * width) + (
            self.learned_positions * self.hidden
        )
        return self.active_param_count() - lookups

    def kv_cache_elems_per_token(self) -> int:
        """Values cached per token in one layer: K and V, ``2 * n_kv_heads * head_dim``.

        The KV cache's size (and a decode step's read of it) is this times layers, tokens and
        bytes per value. MLA caches the compressed latent plus the shared rotary key instead,
        ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V2/V3, against 128 x (192 + 128) =
        40,960 for its heads' K and V expanded); that is what MLA-aware engines store, not what
        an implementation that expands K and V before caching them would.
        """
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim
