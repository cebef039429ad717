"""What the performance model needs to know of a model's architecture: its shapes and sizes.

Kept apart from the performance model so that reading a Hugging Face ``config.json`` and
counting parameters, which every planner and simulator input goes through, can grow per model
family without touching the timing model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetshift_daemon.core.errors import InvalidModelArch

__all__ = ["ModelArch"]


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

    def active_param_count(self) -> int:
        """Parameters each token is multiplied through: what sets a forward pass's FLOPs.

        A dense model touches every parameter, so this equals ``param_count()``; a mixture of
        experts touches only its shared and routed-to experts.
        """
        return self.param_count()

    def kv_cache_elems_per_token(self) -> int:
        """Values of K and V cached per token in one layer: ``2 * n_kv_heads * head_dim``.

        The KV cache's size (and a decode step's read of it) is this times layers, tokens and
        bytes per value; attention that caches something else (MLA's latent) overrides it.
        """
        return 2 * self.n_kv_heads * self.head_dim
