"""Published models of every family from_hf_config reads: sizes, config classes, figures.

Shared by ``test_archs.py`` and ``bench/arch_counts.py``.

Each family's config comes from instantiating its real ``transformers`` config class with the
published model's sizes (``to_dict()``: every key and default exactly as a saved config.json
would carry them; nothing is downloaded). Counts are checked two ways: against the published
size (within 1 %), and exactly against the model ``transformers`` itself builds from that
config on torch's meta device, which allocates no memory.

Published sizes, all including the embeddings: the Llama-2 paper's 7B and 70B (Hugging Face
counts 6.74B, 68.98B); Mistral-7B 7.24B; Mixtral-8x7B 46.7B total; Qwen2-7B 7.62B;
Qwen1.5-MoE-A2.7B 14.3B; Qwen3-8B 8.2B; Qwen3-30B-A3B 30.5B; Gemma-7B 8.54B; Gemma-2-9B 9.24B;
Phi-2 2.78B; Phi-3-mini 3.82B; GPT-2 124M and GPT-2 XL 1558M (the sizes OpenAI's released
checkpoints are named by, where the paper said 117M and 1542M); GPT-NeoX-20B 20.6B; GPT-J-6B
6.05B; OPT-6.7B 6.66B; Falcon-7B 6.92B; BLOOM-560m 559M and BLOOM-176B 176B; DeepSeek-V2
236B, V2-Lite 15.7B, V3 671B (V3's model card: the 685B on Hugging Face is 671B of main model
plus the 14B multi-token-prediction module, which is not part of the served model and which
``transformers`` does not build either).

Published active figures follow two conventions. Mixtral's 12.9B and Qwen1.5-MoE's 2.7B count
both embedding tables (``active_param_count()``: 12.88B, 2.69B). DeepSeek's "activated" figures
fit a count without the input embedding table, a lookup rather than a product
(``forward_param_count()``): V2 20.85B against 21B, V3 36.63B against 37B; with the table they
would be 21.38B and 37.55B, 1.8 % and 1.5 % off. Each is checked within 1 %, or within the
rounding of the published figure where that is coarser ("37B" says 36.5B to 37.5B; V3's 36.63B
is 1.01 % under 37B). DeepSeek-V2-Lite's card says 2.4B activated, which neither convention
reaches within 1 % (2.45B without the input table, 2.66B with it), and Qwen3-30B-A3B's card says
3.3B activated against 3.35B counted Qwen's way, with both tables (1.6 % off; 3.04B without
the input table): for those two only the total is checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

__all__ = ["PUBLISHED", "Published", "figure", "transformers_count"]


@dataclasses.dataclass(frozen=True)
class Published:
    """A published model: its config class, its config.json sizes, its published size."""

    config_class: str
    sizes: dict[str, Any]
    total: str  # as published: "6.74B"
    active: str | None = None  # published active parameters (MoE), as written: "12.9B"
    active_excludes_input_embedding: bool = False  # DeepSeek's convention

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = getattr(transformers, self.config_class)(**self.sizes).to_dict()
        return cfg


_DEEPSEEK_MLA = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}

PUBLISHED: dict[str, Published] = {
    "llama-2-7b": Published(
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
        ),
        "6.74B",
    ),
    "llama-2-70b": Published(
        "LlamaConfig",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
        "69.0B",
    ),
    "mistral-7b": Published(
        "MistralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
        "7.24B",
    ),
    "mixtral-8x7b": Published(
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "46.7B",
        active="12.9B",
    ),
    "qwen2-7b": Published(
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),
        "7.62B",
    ),
    "qwen1.5-moe-a2.7b": Published(
        "Qwen2MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=151936,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            decoder_sparse_step=1,
        ),
        "14.3B",
        active="2.7B",
    ),
    "gemma-7b": Published(
        "GemmaConfig",
        dict(
            hidden_size=3072,
            intermediate_size=24576,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=256,
            vocab_size=256000,
        ),
        "8.54B",
    ),
    "gemma-2-9b": Published(
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
        ),
        "9.24B",
    ),
    "qwen3-8b": Published(
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
        "8.2B",
    ),
    "qwen3-30b-a3b": Published(
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
        ),
        "30.5B",  # its card's 3.3B activated is not checked: see the module docstring
    ),
    "phi-2": Published(
        "PhiConfig",
        dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=32,
            num_attention_heads=32,
            vocab_size=51200,
        ),
        "2.78B",
    ),
    "phi-3-mini": Published(
        "Phi3Config",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
        ),
        "3.82B",
    ),
    "gpt2": Published(
        "GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024), "124M"
    ),
    "gpt2-xl": Published(
        "GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024), "1558M"
    ),
    "gpt-neox-20b": Published(
        "GPTNeoXConfig",
        dict(
            hidden_size=6144,
            intermediate_size=24576,
            num_hidden_layers=44,
            num_attention_heads=64,
            vocab_size=50432,
        ),
        "20.6B",
    ),
    "gpt-j-6b": Published(
        "GPTJConfig",
        dict(n_embd=4096, n_layer=28, n_head=16, vocab_size=50400, rotary_dim=64),
        "6.05B",
    ),
    "opt-6.7b": Published(
        "OPTConfig",
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            ffn_dim=16384,
            vocab_size=50272,
            max_position_embeddings=2048,
            word_embed_proj_dim=4096,
        ),
        "6.66B",
    ),
    "falcon-7b": Published(
        "FalconConfig",
        dict(
            hidden_size=4544,
            num_hidden_layers=32,
            num_attention_heads=71,
            vocab_size=65024,
            multi_query=True,
            parallel_attn=True,
        ),
        "6.92B",
    ),
    "bloom-560m": Published(
        "BloomConfig", dict(hidden_size=1024, n_layer=24, n_head=16, vocab_size=250880), "559M"
    ),
    "bloom-176b": Published(
        "BloomConfig", dict(hidden_size=14336, n_layer=70, n_head=112, vocab_size=250880), "176B"
    ),
    "deepseek-v2": Published(
        "DeepseekV2Config",
        dict(
            hidden_size=5120,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=60,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=160,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            vocab_size=102400,
            **_DEEPSEEK_MLA,
        ),
        "236B",
        active="21B",
        active_excludes_input_embedding=True,
    ),
    "deepseek-v2-lite": Published(
        "DeepseekV2Config",
        dict(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            vocab_size=102400,
            **{**_DEEPSEEK_MLA, "q_lora_rank": None},  # V2-Lite projects queries directly
        ),
        "15.7B",  # its card's 2.4B activated is not checked: see the module docstring
    ),
    "deepseek-v3": Published(
        "DeepseekV3Config",
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            vocab_size=129280,
            **_DEEPSEEK_MLA,
        ),
        "671B",
        active="37B",
        active_excludes_input_embedding=True,
    ),
}


def figure(published: str) -> tuple[float, float]:
    """A published figure ("37B") and how far a count may be from it to match it.

    1 %, or half a unit of its last written digit where the figure is rounded more coarsely:
    "37B" only says 36.5B-37.5B, and a count that rounds to it matches it.
    """
    digits = published.rstrip("BM")
    scale = 1e9 if published.endswith("B") else 1e6
    decimals = len(digits.partition(".")[2])
    value = float(digits) * scale
    return value, max(0.01 * value, 0.5 * 10.0**-decimals * scale)


def transformers_count(cfg: dict[str, Any]) -> int:
    """What ``transformers`` itself builds from ``cfg``: on the meta device, no memory."""
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights once
