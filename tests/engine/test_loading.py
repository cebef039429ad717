"""Model directories load by their Hugging Face names, and bad input is named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fleetshift_agent.engine import EngineConfig, SamplingParams
from fleetshift_agent.engine.factory import engine_from_dir
from fleetshift_agent.engine.make_model import PRESETS, random_model
from fleetshift_agent.engine.weights import load_model_dir, save_model_dir, weights_digest
from fleetshift_common.errors import AlreadyExists, InvalidArgument

from .helpers import REQUESTS, new_engine, run_all


def test_tiny_model_uses_hugging_face_tensor_names(tiny_model: Path) -> None:
    names = set(load_file(str(tiny_model / "model.safetensors")))
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.embed_tokens.weight" in names
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # grouped-query attention


def test_sharded_directory_gives_the_same_tokens(tmp_path: Path, tiny_model: Path) -> None:
    model = load_model_dir(tiny_model)
    paths = save_model_dir(model, tmp_path, shard_bytes=100_000)
    assert len(paths) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert run_all(tmp_path, REQUESTS) == run_all(tiny_model, REQUESTS)


def test_untied_model_round_trips(tmp_path: Path) -> None:
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=False)
    model = random_model(cfg, seed=1)
    save_model_dir(model, tmp_path)
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_model_dir(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_digest_follows_the_bytes(tmp_path: Path, tiny_model: Path) -> None:
    save_model_dir(load_model_dir(tiny_model), tmp_path)
    assert weights_digest(tmp_path) == weights_digest(tiny_model)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert weights_digest(tmp_path) != weights_digest(tiny_model)


def test_missing_tensor_is_named(tmp_path: Path, tiny_model: Path) -> None:
    tensors = load_file(str(tiny_model / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(InvalidArgument) as err:
        load_model_dir(tmp_path)
    assert err.value.field == "model.layers.1.mlp.up_proj.weight"


def test_wrong_shape_is_named(tmp_path: Path, tiny_model: Path) -> None:
    tensors = load_file(str(tiny_model / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(InvalidArgument) as err:
        engine_from_dir(tmp_path, EngineConfig())
    assert err.value.field == "model.norm.weight"


@pytest.mark.parametrize(
    ("prompt", "max_new", "field"),
    [
        ([], 4, "prompt_tokens"),
        ([1, 100_000], 4, "prompt_tokens"),
        ([1, -1], 4, "prompt_tokens"),
        ([1, 2], 0, "max_new_tokens"),
        ([1, 2], 10_000, "max_new_tokens"),
    ],
)
def test_bad_requests_name_the_field(
    tiny_model: Path, prompt: list[int], max_new: int, field: str
) -> None:
    engine = new_engine(tiny_model)
    with pytest.raises(InvalidArgument) as err:
        engine.add_session("s", prompt, max_new, SamplingParams())
    assert err.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_bad_sampling_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_duplicate_session_id_is_refused(tiny_model: Path) -> None:
    engine = new_engine(tiny_model)
    engine.add_session("s", [1], 2, SamplingParams())
    with pytest.raises(AlreadyExists):
        engine.add_session("s", [1], 2, SamplingParams())


def test_kv_capacity_is_reported_and_given_back(tiny_model: Path) -> None:
    engine = new_engine(tiny_model, num_blocks=32, block_size=16)
    engine.add_session("s", list(range(40)), 4, SamplingParams())
    engine.step()
    during = engine.counters()
    assert (during.kv_blocks_used, during.kv_blocks_total) == (3, 32)
    while engine.has_work():
        engine.step()
    after = engine.counters()
    assert after.kv_blocks_used == 0
    assert after.prefill_tokens == 40 and after.decode_tokens == 3
    assert len(after.ttft_ms) == 1 and len(after.tbt_ms) == 3
