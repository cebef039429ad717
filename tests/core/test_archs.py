"""ModelArch.from_hf_config against the real config classes and models of ``transformers``.

The models, their published sizes and where each figure comes from are in
``published_models.py``; this file checks the counts, the defaults and every refusal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.errors import InvalidModelArch
from fleetshift_daemon.core.hf_config import FAMILIES
from fleetshift_daemon.core.perfmodel import ModelArch as ReexportedModelArch
from fleetshift_daemon.core.perfmodel import llama2_70b
from tests.core.published_models import PUBLISHED, figure, transformers_count


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_size_and_what_transformers_builds(
    model: str,
) -> None:
    published = PUBLISHED[model]
    cfg = published.config()
    arch = ModelArch.from_hf_config(model, cfg)
    assert arch.family == cfg["model_type"]
    expected, tolerance = figure(published.total)
    assert arch.param_count() == pytest.approx(expected, abs=tolerance)
    assert arch.param_count() == transformers_count(cfg)


@pytest.mark.parametrize("model", sorted(m for m, p in PUBLISHED.items() if p.active))
def test_mixture_of_experts_active_parameters_match_the_publishedfigure(model: str) -> None:
    published = PUBLISHED[model]
    assert published.active is not None
    arch = ModelArch.from_hf_config(model, published.config())
    assert arch.moe is not None
    active = (
        arch.forward_param_count()
        if published.active_excludes_input_embedding
        else arch.active_param_count()
    )
    expected, tolerance = figure(published.active)
    assert active == pytest.approx(expected, abs=tolerance)
    assert arch.forward_param_count() < arch.active_param_count() < arch.param_count()


def test_a_published_figure_matches_within_1_percent_or_its_own_rounding() -> None:
    assert figure("37B") == (37e9, pytest.approx(0.5e9))  # 36.5B-37.5B
    assert figure("12.9B") == (12.9e9, pytest.approx(0.129e9))  # 1 % is wider than 0.05B
    assert figure("2.4B") == (2.4e9, pytest.approx(0.05e9))
    assert figure("559M") == (559e6, pytest.approx(5.59e6))


def test_every_family_it_claims_is_tested_against_a_published_model() -> None:
    tested = {PUBLISHED[m].config()["model_type"] for m in PUBLISHED}
    assert tested == set(FAMILIES)


def test_dense_models_touch_every_parameter_per_token() -> None:
    for model in ("llama-2-7b", "gpt2", "falcon-7b", "bloom-560m"):
        arch = ModelArch.from_hf_config(model, PUBLISHED[model].config())
        assert arch.moe is None
        assert arch.active_param_count() == arch.param_count()
    assert llama2_70b().active_param_count() == llama2_70b().param_count() == 68_976_648_192


def test_moe_counts_shared_and_top_k_experts_as_active_and_every_expert_in_total() -> None:
    arch = ModelArch.from_hf_config("dsv3", PUBLISHED["deepseek-v3"].config())
    moe = arch.moe
    assert moe is not None
    assert (moe.n_experts, moe.experts_per_token, moe.n_shared_experts) == (256, 8, 1)
    assert moe.n_moe_layers == 61 - 3  # first_k_dense_replace = 3 dense layers
    one_expert = 3 * 7168 * 2048
    # the 248 routed experts a token does not visit, in each of the 58 MoE layers
    assert arch.param_count() - arch.active_param_count() == 58 * 248 * one_expert
    qwen = ModelArch.from_hf_config("qwen", PUBLISHED["qwen1.5-moe-a2.7b"].config())
    assert qwen.moe is not None and qwen.moe.shared_expert_gate
    assert qwen.moe.shared_intermediate == 5632 and qwen.moe.n_moe_layers == 24


def test_qwen2_moe_sparse_step_and_mlp_only_layers_make_dense_layers() -> None:
    base = PUBLISHED["qwen1.5-moe-a2.7b"].config()
    for changes, moe_layers in (
        ({"decoder_sparse_step": 2}, 12),  # layers 1, 3, 5 ... (i + 1) % 2 == 0
        ({"mlp_only_layers": [0, 1, 2]}, 21),
        ({"decoder_sparse_step": 3, "mlp_only_layers": [2]}, 7),
    ):
        cfg = {**base, **changes}
        arch = ModelArch.from_hf_config("q", cfg)
        assert arch.moe is not None and arch.moe.n_moe_layers == moe_layers
        assert arch.param_count() == transformers_count(cfg)


def test_mla_caches_the_latent_and_rope_key_not_per_head_k_and_v() -> None:
    for model in ("deepseek-v2", "deepseek-v3", "deepseek-v2-lite"):
        arch = ModelArch.from_hf_config(model, PUBLISHED[model].config())
        assert arch.mla is not None
        assert arch.kv_cache_elems_per_token() == 512 + 64  # kv_lora_rank + qk_rope_head_dim
        assert arch.head_dim == 192 and arch.n_kv_heads == arch.n_heads
    lite = ModelArch.from_hf_config("lite", PUBLISHED["deepseek-v2-lite"].config())
    assert lite.mla is not None and lite.mla.q_lora_rank == 0


@pytest.mark.parametrize(
    ("model", "elems"),
    [
        ("llama-2-70b", 2 * 8 * 128),  # grouped-query: 8 KV heads
        ("mistral-7b", 2 * 8 * 128),
        ("falcon-7b", 2 * 1 * 64),  # multi-query: one KV head of 4544 / 71
        ("gpt2", 2 * 12 * 64),
        ("gemma-7b", 2 * 16 * 256),  # head_dim 256 from the key, not 3072 / 16
    ],
)
def test_kv_cache_per_token_counts_k_and_v_of_each_kv_head(model: str, elems: int) -> None:
    arch = ModelArch.from_hf_config(model, PUBLISHED[model].config())
    assert arch.kv_cache_elems_per_token() == elems


def test_the_mlp_kind_comes_from_the_family_not_from_hidden_act() -> None:
    llama = PUBLISHED["llama-2-7b"].config()
    neox = PUBLISHED["gpt-neox-20b"].config()
    as_read = ModelArch.from_hf_config("l", llama)
    for act in ("gelu", "relu", None):
        changed = {**llama, "hidden_act": act}
        if act is None:
            del changed["hidden_act"]
        assert ModelArch.from_hf_config("l", changed) == as_read
        assert ModelArch.from_hf_config("l", changed).gated_mlp
    assert not ModelArch.from_hf_config("n", {**neox, "hidden_act": "silu"}).gated_mlp
    gemma = ModelArch.from_hf_config("g", PUBLISHED["gemma-7b"].config())
    assert gemma.gated_mlp  # GeGLU: gated, though its hidden_act is a gelu


@pytest.mark.parametrize(
    ("model", "tied"),
    [
        ("llama-2-7b", False),
        ("mistral-7b", False),
        ("qwen2-7b", False),
        ("gemma-7b", True),
        ("gemma-2-9b", True),
        ("qwen3-8b", False),
        ("phi-2", False),
        ("gpt2", True),
        ("gpt-j-6b", False),
        ("gpt-neox-20b", False),
        ("opt-6.7b", True),
        ("falcon-7b", True),
        ("bloom-560m", True),
        ("deepseek-v3", False),
    ],
)
def test_a_config_without_tie_word_embeddings_gets_its_familys_default(
    model: str, tied: bool
) -> None:
    cfg = {k: v for k, v in PUBLISHED[model].config().items() if k != "tie_word_embeddings"}
    arch = ModelArch.from_hf_config(model, cfg)
    assert arch.tied_embeddings is tied
    assert arch.param_count() == transformers_count(cfg)


@pytest.mark.parametrize(
    ("model", "changes"),
    [
        ("llama-2-7b", {"attention_bias": True, "mlp_bias": True}),
        ("llama-2-7b", {"head_dim": 64, "num_key_value_heads": 8}),
        ("phi-2", {"qk_layernorm": True, "num_key_value_heads": 8}),
        ("gpt-neox-20b", {"attention_bias": False, "use_parallel_residual": False}),
        ("falcon-7b", {"multi_query": False, "parallel_attn": False, "bias": True}),
        (
            "falcon-7b",
            {
                "hidden_size": 8192,
                "num_attention_heads": 128,
                "num_hidden_layers": 4,
                "new_decoder_architecture": True,
                "num_kv_heads": 8,
            },
        ),
        ("falcon-7b", {"new_decoder_architecture": True, "num_ln_in_parallel_attn": 1}),
        ("opt-6.7b", {"word_embed_proj_dim": 512, "do_layer_norm_before": False}),
        ("opt-6.7b", {"enable_bias": False, "layer_norm_elementwise_affine": False}),
        ("qwen2-7b", {"tie_word_embeddings": True}),
        ("qwen3-8b", {"attention_bias": True}),
        ("qwen3-30b-a3b", {"decoder_sparse_step": 2, "mlp_only_layers": [1]}),
        ("deepseek-v2", {"attention_bias": True, "first_k_dense_replace": 5}),
    ],
)
def test_family_variants_count_what_transformers_builds(
    model: str, changes: dict[str, Any]
) -> None:
    cfg = {**PUBLISHED[model].config(), **changes}
    assert ModelArch.from_hf_config(model, cfg).param_count() == transformers_count(cfg)


# Published config.json files carry older key spellings that the config classes still accept:
# written here from the models' own config.json, as a saved file holds them.
BLOOM_560M_CONFIG_JSON = {
    "model_type": "bloom",
    "n_embed": 1024,
    "n_layer": 24,
    "num_attention_heads": 16,
    "vocab_size": 250880,
    "apply_residual_connection_post_layernorm": False,
    "layer_norm_epsilon": 1e-05,
}
FALCON_7B_CONFIG_JSON = {
    "model_type": "falcon",
    "alibi": False,
    "bias": False,
    "hidden_size": 4544,
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
    "vocab_size": 65024,
}
PHI_2_CONFIG_JSON = {
    "model_type": "phi",
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": None,
    "partial_rotary_factor": 0.4,
    "qk_layernorm": False,
    "tie_word_embeddings": False,
    "vocab_size": 51200,
}


@pytest.mark.parametrize(
    ("cfg", "published"),
    [
        (BLOOM_560M_CONFIG_JSON, 559_214_592),
        (FALCON_7B_CONFIG_JSON, 6_921_720_704),
        (PHI_2_CONFIG_JSON, 2_779_683_840),
    ],
)
def test_published_config_json_spellings_read_the_same(cfg: dict[str, Any], published: int) -> None:
    assert ModelArch.from_hf_config("m", cfg).param_count() == published
    assert transformers_count(cfg) == published


def test_an_unknown_or_missing_model_type_is_refused_by_name() -> None:
    cfg = PUBLISHED["llama-2-7b"].config()
    for bad in ({**cfg, "model_type": "mamba"}, {**cfg, "model_type": 7}):
        with pytest.raises(InvalidModelArch, match="model_type") as err:
            ModelArch.from_hf_config("x", bad)
        assert err.value.field == "model_type"
    with pytest.raises(InvalidModelArch, match="lacks model_type") as err:
        ModelArch.from_hf_config("x", {k: v for k, v in cfg.items() if k != "model_type"})
    assert err.value.field == "model_type"


# Per family, the keys whose absence is refused: sizes, where the config class would fill in
# its own example model's value rather than this model's.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "llama-2-7b": (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ),
    "mistral-7b": ("num_key_value_heads", "intermediate_size", "vocab_size"),
    "mixtral-8x7b": ("num_local_experts", "num_experts_per_tok", "num_key_value_heads"),
    "qwen2-7b": ("num_key_value_heads", "hidden_size"),
    "qwen1.5-moe-a2.7b": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "intermediate_size",
    ),
    "gemma-7b": ("head_dim", "num_key_value_heads"),
    "gemma-2-9b": ("head_dim", "intermediate_size"),
    "qwen3-8b": ("head_dim", "num_key_value_heads"),
    "qwen3-30b-a3b": ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "phi-2": ("hidden_size", "intermediate_size"),
    "phi-3-mini": ("num_hidden_layers", "vocab_size"),
    "gpt2": ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"),
    "gpt-neox-20b": ("intermediate_size", "num_attention_heads"),
    "gpt-j-6b": ("n_embd", "n_layer", "n_head", "vocab_size"),
    "opt-6.7b": ("ffn_dim", "max_position_embeddings", "hidden_size"),
    "falcon-7b": ("hidden_size", "num_attention_heads", "vocab_size"),
    "bloom-560m": ("hidden_size", "n_layer", "n_head"),
    "deepseek-v2": (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        "first_k_dense_replace",
        "intermediate_size",
    ),
    "deepseek-v3": ("first_k_dense_replace", "n_shared_experts", "q_lora_rank"),
}


@pytest.mark.parametrize(
    ("model", "key"), [(m, k) for m, keys in REQUIRED_KEYS.items() for k in keys]
)
def test_a_missing_size_is_refused_naming_the_key(model: str, key: str) -> None:
    cfg = PUBLISHED[model].config()
    assert key in cfg, f"{key} is not a key of {model}'s real config"
    without = {k: v for k, v in cfg.items() if k != key}
    with pytest.raises(InvalidModelArch, match=f"lacks {key}") as err:
        ModelArch.from_hf_config(model, without)
    assert err.value.field == key


@pytest.mark.parametrize(
    ("model", "key", "value"),
    [
        ("llama-2-7b", "hidden_size", "big"),
        ("llama-2-7b", "num_hidden_layers", 0),
        ("llama-2-7b", "num_key_value_heads", -8),
        ("mistral-7b", "num_key_value_heads", 7),  # does not divide 32 heads
        ("llama-2-7b", "tie_word_embeddings", "no"),
        ("mixtral-8x7b", "num_experts_per_tok", 9),  # more than its 8 experts
        ("qwen1.5-moe-a2.7b", "mlp_only_layers", "all"),
        ("gpt2", "n_head", 5),  # does not divide 768
        ("gpt2", "add_cross_attention", True),  # layers it does not count
        ("deepseek-v2", "mlp_bias", True),
        ("deepseek-v2", "first_k_dense_replace", -1),
        ("deepseek-v3", "n_routed_experts", True),
    ],
)
def test_a_bad_value_is_refused_naming_the_key(model: str, key: str, value: object) -> None:
    cfg = {**PUBLISHED[model].config(), key: value}
    with pytest.raises(InvalidModelArch) as err:
        ModelArch.from_hf_config(model, cfg)
    assert err.value.field == key
    assert key in str(err.value)


def test_two_spellings_of_one_key_that_disagree_are_refused() -> None:
    cfg = {**PUBLISHED["gpt2"].config(), "hidden_size": 1024}
    with pytest.raises(InvalidModelArch, match="n_embd and hidden_size") as err:
        ModelArch.from_hf_config("g", cfg)
    assert err.value.field == "n_embd"
    same = {**PUBLISHED["gpt2"].config(), "hidden_size": 768}
    assert ModelArch.from_hf_config("g", same).hidden == 768


def test_a_non_object_config_is_refused() -> None:
    with pytest.raises(InvalidModelArch) as err:
        ModelArch.from_hf_config("x", ["model_type", "llama"])  # type: ignore[arg-type]
    assert err.value.field == "config"


def test_perfmodel_still_exports_the_same_class() -> None:
    assert ReexportedModelArch is ModelArch


def test_hand_built_archs_keep_their_meaning() -> None:
    # The positional form the planner, benchmarks and tests use: a Llama-3-8B.
    small = ModelArch("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 128)
    assert small.param_count() == 8_030_261_248  # HF count of Meta-Llama-3-8B
    assert small.kv_cache_elems_per_token() == 2 * 8 * 128
    assert small == dataclasses.replace(small, family="llama")  # provenance, not shape
    gptj = ModelArch("gptj-6b", 28, 4096, 16, 16, 16384, 50400, 256, gated_mlp=False)
    assert gptj.layer_params == 4 * 4096 * 4096 + 2 * 4096 * 16384 + 2 * 4096


def test_hand_built_moe_and_mla_shapes_must_agree() -> None:
    v3 = ModelArch.from_hf_config("v3", PUBLISHED["deepseek-v3"].config())
    with pytest.raises(InvalidModelArch) as err:
        dataclasses.replace(v3, head_dim=128)  # MLA's query/key heads are 128 + 64 wide
    assert err.value.field == "head_dim"
    assert v3.moe is not None
    with pytest.raises(InvalidModelArch) as err:
        dataclasses.replace(v3, moe=dataclasses.replace(v3.moe, n_moe_layers=62))
    assert err.value.field == "n_moe_layers"
    with pytest.raises(InvalidModelArch) as err:
        dataclasses.replace(v3.moe, experts_per_token=257)
    assert err.value.field == "experts_per_token"
