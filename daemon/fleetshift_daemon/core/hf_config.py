"""Read a Hugging Face ``config.json`` into a ``ModelArch``, family by family, never guessing.

A ``config.json`` only lists what differs from its family's config class, so what a missing
key means depends on the family: ``tie_word_embeddings`` is True unless the class says
otherwise (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Phi, Phi-3, GPT-J, NeoX and DeepSeek say
False), Qwen2 has Q/K/V biases
that no key mentions, GPT-J's LM head has a bias, BLOOM's MLP is always 4 x hidden. Each reader
below follows its family's ``transformers`` config class and modeling code (5.x), so the counts
match what ``transformers`` builds. The MLP kind comes from the family, never from
``hidden_act``.

What is refused, with the key named (``InvalidModelArch.field``):

- a ``model_type`` missing or not among ``FAMILIES``;
- a missing size (layers, widths, heads, vocabulary, experts ...): the class would fill in its
  own example model's size, which is not this model's, so no size is ever assumed; a key that
  only derives from others (``head_dim`` = hidden / heads, GPT-2's ``n_inner`` = 4 x hidden,
  Llama's ``num_key_value_heads`` = heads) takes that derivation, as the class does;
- a value of the wrong type, and a feature whose parameters this module does not count.

Flags (biases, tying, norms) take the family's class default; ``tests/core/test_archs.py``
checks every family, with and without those keys, against what ``transformers`` 5.23 builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from fleetshift_daemon.core.archs import MlaSpec, ModelArch, MoeSpec
from fleetshift_daemon.core.errors import InvalidModelArch

__all__ = ["FAMILIES", "read_hf_config"]

Fields = dict[str, Any]


class _Keys:
    """One config's values, read under the family's key names (and their aliases)."""

    def __init__(self, family: str, cfg: Mapping[str, Any]) -> None:
        self.family = family
        self.cfg = cfg

    def _value(self, key: str, aliases: tuple[str, ...]) -> Any:
        found = {k: self.cfg[k] for k in (key, *aliases) if self.cfg.get(k) is not None}
        if len(set(map(repr, found.values()))) > 1:
            raise InvalidModelArch(
                f"{self.family} config gives {' and '.join(found)} different values",
                field=key,
            )
        return next(iter(found.values()), None)

    def _int(self, key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise InvalidModelArch(
                f"{self.family} config's {key} must be {rule}, got {value!r}", field=key
            )
        return value

    def _missing(self, key: str, aliases: tuple[str, ...] = ()) -> InvalidModelArch:
        spelled = f"{key} (or {', '.join(aliases)})" if aliases else key
        return InvalidModelArch(
            f"{self.family} config lacks {spelled}, and its default is not certain for this model",
            field=key,
        )

    def size(self, key: str, *aliases: str, minimum: int = 1) -> int:
        """A required integer: missing, null or out of range is refused."""
        value = self._value(key, aliases)
        if value is None:
            raise self._missing(key, aliases)
        return self._int(key, value, minimum)

    def size_or(self, key: str, default: int, *aliases: str) -> int:
        """An integer whose absence (or null) means ``default``, as the family's class says."""
        value = self._value(key, aliases)
        return default if value is None else self._int(key, value, 1)

    def nullable_size(self, key: str) -> int:
        """A key that must be present, where null means "none" (0): DeepSeek's q_lora_rank."""
        if key not in self.cfg:
            raise self._missing(key)
        value = self.cfg[key]
        return 0 if value is None else self._int(key, value, 0)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidModelArch(
                f"{self.family} config's {key} must be true or false, got {value!r}", field=key
            )
        return value

    def absent_or_false(self, key: str, why: str) -> None:
        """Refuse a feature whose parameters are not counted here rather than miscount it."""
        if self.flag(key, False):
            raise InvalidModelArch(f"{self.family} config sets {key}: {why}", field=key)

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.cfg.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value
        ):
            raise InvalidModelArch(
                f"{self.family} config's {key} must be a list of layer indices", field=key
            )
        return tuple(value)

    def kv_heads(self, key: str, heads: int, default: int | None) -> int:
        """KV heads (required when ``default`` is None), which must divide the query heads."""
        kv = self.size(key) if default is None else self.size_or(key, default)
        if heads % kv:
            raise InvalidModelArch(
                f"{self.family} config's {key} ({kv}) does not divide its {heads} attention heads",
                field=key,
            )
        return kv

    def top_k(self, n_experts: int) -> int:
        k = self.size("num_experts_per_tok")
        if k > n_experts:
            raise InvalidModelArch(
                f"{self.family} config's num_experts_per_tok ({k}) exceeds its {n_experts} "
                "routed experts",
                field="num_experts_per_tok",
            )
        return k

    def split_head_dim(self, hidden: int, heads: int, heads_key: str) -> int:
        if hidden % heads:
            raise InvalidModelArch(
                f"{self.family} config's {heads_key} ({heads}) does not divide its hidden "
                f"size ({hidden})",
                field=heads_key,
            )
        return hidden // heads


def _layer_norm() -> Fields:
    return {"norm_vectors": 2}  # LayerNorm: weight and bias


def _rotary_decoder(
    k: _Keys, kv_heads: Literal["heads", "required", "unused"], head_dim_key: bool = True
) -> Fields:
    """The Llama-shaped keys most families share.

    ``kv_heads``: "heads" where the class fills a missing ``num_key_value_heads`` in with the
    attention heads (Llama, Phi), "required" where it fills in a size of its own (Mistral 8,
    Qwen2 32, Gemma 16), "unused" where the family has no such key (GPT-NeoX).
    """
    hidden = k.size("hidden_size")
    heads = k.size("num_attention_heads")
    if kv_heads == "unused":
        kv = heads
    else:
        kv = k.kv_heads("num_key_value_heads", heads, heads if kv_heads == "heads" else None)
    head_dim = k.size_or("head_dim", 0) if head_dim_key else 0
    if not head_dim:  # the class's rule where the key is absent: hidden / heads
        head_dim = k.split_head_dim(hidden, heads, "num_attention_heads")
    return {
        "n_layers": k.size("num_hidden_layers"),
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": kv,
        "intermediate": k.size("intermediate_size"),
        "vocab": k.size("vocab_size"),
        "head_dim": head_dim,
    }


def _llama(k: _Keys) -> Fields:
    bias = k.flag("attention_bias", False)
    return {
        **_rotary_decoder(k, kv_heads="heads"),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": k.flag("mlp_bias", False),
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _mistral(k: _Keys) -> Fields:
    # MistralConfig's num_key_value_heads defaults to 8, Mistral-7B's own: a size, not a rule.
    return {
        **_rotary_decoder(k, kv_heads="required"),
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _mixtral(k: _Keys) -> Fields:
    fields = _mistral(k)
    n_experts = k.size("num_local_experts", "num_experts")
    fields["moe"] = MoeSpec(
        n_experts=n_experts,
        experts_per_token=k.top_k(n_experts),
        expert_intermediate=fields["intermediate"],  # every layer is MoE; no dense MLP
        n_moe_layers=fields["n_layers"],
    )
    return fields


def _qwen2(k: _Keys) -> Fields:
    return {
        **_rotary_decoder(k, kv_heads="required"),
        "qkv_bias": True,  # Qwen2Attention: bias=True on q/k/v, none on o, with no key for it
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _qwen_sparse_layers(k: _Keys, n_layers: int) -> int:
    """Qwen2/3-MoE decoder layers: sparse where not in mlp_only_layers and (i + 1) % step == 0."""
    step = k.size_or("decoder_sparse_step", 1)
    dense_only = set(k.int_list("mlp_only_layers"))
    return sum(1 for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0)


def _qwen2_moe(k: _Keys) -> Fields:
    fields = _rotary_decoder(k, kv_heads="required")
    n_experts = k.size("num_experts")
    fields["moe"] = MoeSpec(
        n_experts=n_experts,
        experts_per_token=k.top_k(n_experts),
        expert_intermediate=k.size("moe_intermediate_size"),
        n_moe_layers=_qwen_sparse_layers(k, fields["n_layers"]),
        n_shared_experts=1,
        shared_intermediate=k.size("shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )
    fields["qkv_bias"] = k.flag("qkv_bias", True)
    fields["tied_embeddings"] = k.flag("tie_word_embeddings", False)
    return fields


def _gemma(k: _Keys) -> Fields:
    # GemmaConfig's head_dim defaults to 256, Gemma-7B's; Gemma-2B's is also 256 with a
    # hidden of 2048 / 8 heads, so hidden / heads is not the rule: the key is required.
    fields = _rotary_decoder(k, kv_heads="required", head_dim_key=False)
    fields["head_dim"] = k.size("head_dim")
    bias = k.flag("attention_bias", False)
    fields.update(qkv_bias=bias, o_bias=bias, tied_embeddings=k.flag("tie_word_embeddings", True))
    return fields


def _gemma2(k: _Keys) -> Fields:
    # Gemma2DecoderLayer adds a norm before and after the MLP to Gemma's two.
    return {**_gemma(k), "norms_per_layer": 4}


def _qwen3(k: _Keys) -> Fields:
    # Qwen3Attention: an RMSNorm over each query and key head, biases per attention_bias.
    # Qwen3Config's head_dim defaults to 128, not hidden / heads (Qwen3-0.6B: 1024 / 16 heads
    # of 128), so the key is required.
    fields = _rotary_decoder(k, kv_heads="required", head_dim_key=False)
    fields["head_dim"] = k.size("head_dim")
    bias = k.flag("attention_bias", False)
    fields.update(qkv_bias=bias, o_bias=bias, qk_norm=True)
    fields["tied_embeddings"] = k.flag("tie_word_embeddings", False)
    return fields


def _qwen3_moe(k: _Keys) -> Fields:
    # Qwen3MoeAttention reads head_dim where given, else hidden / heads; sparse layers as in
    # Qwen2-MoE, with no shared expert.
    fields = _rotary_decoder(k, kv_heads="required")
    bias = k.flag("attention_bias", False)
    fields.update(qkv_bias=bias, o_bias=bias, qk_norm=True)
    n_experts = k.size("num_local_experts", "num_experts")
    fields["moe"] = MoeSpec(
        n_experts=n_experts,
        experts_per_token=k.top_k(n_experts),
        expert_intermediate=k.size("moe_intermediate_size"),
        n_moe_layers=_qwen_sparse_layers(k, fields["n_layers"]),
    )
    fields["tied_embeddings"] = k.flag("tie_word_embeddings", False)
    return fields


def _phi(k: _Keys) -> Fields:
    # PhiDecoderLayer: one LayerNorm feeding attention and MLP in parallel, biases everywhere,
    # fc1/fc2 (not gated), an LM head with a bias.
    return {
        **_rotary_decoder(k, kv_heads="heads"),
        **_layer_norm(),
        "gated_mlp": False,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "lm_head_bias": True,
        "norms_per_layer": 1,
        "parallel_attn": True,
        "qk_norm": k.flag("qk_layernorm", False),
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _phi3(k: _Keys) -> Fields:
    # Fused qkv_proj and gate_up_proj: the same matrices as Llama's, no biases.
    return {
        **_rotary_decoder(k, kv_heads="heads"),
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _gpt2(k: _Keys) -> Fields:
    k.absent_or_false("add_cross_attention", "cross-attention layers are not counted")
    hidden = k.size("n_embd", "hidden_size")
    heads = k.size("n_head", "num_attention_heads")
    return {
        "n_layers": k.size("n_layer", "num_hidden_layers"),
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": heads,
        "intermediate": k.size_or("n_inner", 4 * hidden),
        "vocab": k.size("vocab_size"),
        "head_dim": k.split_head_dim(hidden, heads, "n_head"),
        **_layer_norm(),
        "gated_mlp": False,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "learned_positions": k.size("n_positions", "max_position_embeddings"),
        "tied_embeddings": k.flag("tie_word_embeddings", True),
    }


def _gpt_neox(k: _Keys) -> Fields:
    fields = _rotary_decoder(k, kv_heads="unused", head_dim_key=False)  # qkv of 3 x hidden
    bias = k.flag("attention_bias", True)
    return {
        **fields,
        **_layer_norm(),
        "gated_mlp": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": True,
        "parallel_attn": k.flag("use_parallel_residual", True),
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _gptj(k: _Keys) -> Fields:
    hidden = k.size("n_embd", "hidden_size")
    heads = k.size("n_head", "num_attention_heads")
    return {
        "n_layers": k.size("n_layer", "num_hidden_layers"),
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": heads,
        "intermediate": k.size_or("n_inner", 4 * hidden),
        "vocab": k.size("vocab_size"),
        "head_dim": k.split_head_dim(hidden, heads, "n_head"),
        **_layer_norm(),
        "gated_mlp": False,
        "mlp_bias": True,  # fc_in / fc_out have biases; q/k/v/out_proj do not
        "lm_head_bias": True,
        "norms_per_layer": 1,  # ln_1 feeds attention and MLP in parallel
        "parallel_attn": True,
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


def _opt(k: _Keys) -> Fields:
    hidden = k.size("hidden_size")
    heads = k.size("num_attention_heads")
    bias = k.flag("enable_bias", True)
    embed_dim = k.size_or("word_embed_proj_dim", hidden)
    pre_norm = k.flag("do_layer_norm_before", True)
    return {
        "n_layers": k.size("num_hidden_layers"),
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": heads,
        "intermediate": k.size("ffn_dim"),
        "vocab": k.size("vocab_size"),
        "head_dim": k.split_head_dim(hidden, heads, "num_attention_heads"),
        "norm_vectors": 2 if k.flag("layer_norm_elementwise_affine", True) else 0,
        "gated_mlp": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "final_norm": pre_norm and not k.flag("_remove_final_layer_norm", False),
        # OPTLearnedPositionalEmbedding keeps 2 rows more than max_position_embeddings.
        "learned_positions": k.size("max_position_embeddings") + 2,
        "embed_dim": 0 if embed_dim == hidden else embed_dim,
        "tied_embeddings": k.flag("tie_word_embeddings", True),
    }


def _falcon(k: _Keys) -> Fields:
    hidden = k.size("hidden_size", "n_embed")
    heads = k.size("num_attention_heads")
    new_arch = k.flag("new_decoder_architecture", False)
    if new_arch:
        kv = k.kv_heads("num_kv_heads", heads, heads)
    else:
        kv = 1 if k.flag("multi_query", True) else heads
    parallel = k.flag("parallel_attn", True)
    n_ln = k.size_or("num_ln_in_parallel_attn", 2 if new_arch else 1)
    bias = k.flag("bias", False)
    return {
        "n_layers": k.size("num_hidden_layers"),
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": kv,
        "intermediate": k.size_or("ffn_hidden_size", 4 * hidden),
        "vocab": k.size("vocab_size"),
        "head_dim": k.split_head_dim(hidden, heads, "num_attention_heads"),
        **_layer_norm(),
        "gated_mlp": False,
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "norms_per_layer": 2 if not parallel or n_ln == 2 else 1,
        "parallel_attn": parallel,
        "alibi": k.flag("alibi", False),
        "tied_embeddings": k.flag("tie_word_embeddings", True),
    }


def _bloom(k: _Keys) -> Fields:
    hidden = k.size("hidden_size", "n_embed")
    heads = k.size("n_head", "num_attention_heads")
    return {
        "n_layers": k.size("n_layer", "num_hidden_layers"),
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": heads,
        "intermediate": 4 * hidden,  # BloomMLP: dense_h_to_4h, whatever n_inner says
        "vocab": k.size("vocab_size"),
        "head_dim": k.split_head_dim(hidden, heads, "n_head"),
        **_layer_norm(),
        "gated_mlp": False,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "embedding_norm": True,  # word_embeddings_layernorm
        "alibi": True,
        "tied_embeddings": k.flag("tie_word_embeddings", True),
    }


def _deepseek(k: _Keys) -> Fields:
    # Layer i has the MoE MLP when i >= first_k_dense_replace and i % moe_layer_freq == 0, as
    # in DeepSeek's own modeling code (transformers 5 ignores moe_layer_freq, which every
    # published V2/V3 config sets to 1). The V3 multi-token-prediction module
    # (num_nextn_predict_layers) is not part of the served model and is not counted, as
    # neither transformers nor the published 671B figure counts it.
    k.absent_or_false("mlp_bias", "MLP biases of DeepSeek models are not counted")
    hidden = k.size("hidden_size")
    heads = k.size("num_attention_heads")
    n_layers = k.size("num_hidden_layers")
    mla = MlaSpec(
        q_lora_rank=k.nullable_size("q_lora_rank"),
        kv_lora_rank=k.size("kv_lora_rank"),
        qk_nope_head_dim=k.size("qk_nope_head_dim"),
        qk_rope_head_dim=k.size("qk_rope_head_dim"),
        v_head_dim=k.size("v_head_dim"),
    )
    first_dense = k.size("first_k_dense_replace", minimum=0)
    freq = k.size_or("moe_layer_freq", 1)
    expert_width = k.size("moe_intermediate_size")
    shared = k.size("n_shared_experts", minimum=0)
    n_experts = k.size("n_routed_experts")
    moe = MoeSpec(
        n_experts=n_experts,
        experts_per_token=k.top_k(n_experts),
        expert_intermediate=expert_width,
        n_moe_layers=sum(1 for i in range(first_dense, n_layers) if i % freq == 0),
        n_shared_experts=shared,
        shared_intermediate=shared * expert_width,
    )
    bias = k.flag("attention_bias", False)
    return {
        "n_layers": n_layers,
        "hidden": hidden,
        "n_heads": heads,
        "n_kv_heads": heads,  # MLA expands the latent to every head; num_key_value_heads unused
        "intermediate": k.size("intermediate_size"),
        "vocab": k.size("vocab_size"),
        "head_dim": mla.qk_head_dim,
        "qkv_bias": bias,
        "o_bias": bias,
        "moe": moe,
        "mla": mla,
        "tied_embeddings": k.flag("tie_word_embeddings", False),
    }


FAMILIES: dict[str, Callable[[_Keys], Fields]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "phi": _phi,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "gptj": _gptj,
    "opt": _opt,
    "falcon": _falcon,
    "bloom": _bloom,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}


def read_hf_config(name: str, cfg: Mapping[str, Any]) -> ModelArch:
    """The architecture a ``config.json`` describes; ``InvalidModelArch`` names what is wrong."""
    if not isinstance(cfg, Mapping):
        raise InvalidModelArch("a config.json must hold a JSON object", field="config")
    model_type = cfg.get("model_type")
    if model_type is None:
        raise InvalidModelArch(
            "config lacks model_type: without the family, the MLP kind, biases and tied "
            "embeddings would be guesses",
            field="model_type",
        )
    reader = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if reader is None:
        raise InvalidModelArch(
            f"model_type {model_type!r} is not a family FleetShift reads "
            f"(known: {', '.join(sorted(FAMILIES))})",
            field="model_type",
        )
    return ModelArch(name=name, family=model_type, **reader(_Keys(model_type, cfg)))
