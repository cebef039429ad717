"""The daemon reads each served model's config.json at start, and stops on one it cannot read.

A real ``fleetshiftd`` process with a real config file: a model whose ``config.json`` lacks a
key that has no certain default must stop the daemon before it serves, naming that key, rather
than start with a guessed architecture.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from fleetshift_agent.engine.config import ModelConfig as EngineModelConfig
from fleetshift_agent.engine.model import LlamaModel
from fleetshift_common.config import ModelConfig
from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.models import model_arch

MIXTRAL_8X7B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def _write_model_dir(root: Path, cfg: dict[str, object]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return root


def _start_daemon(tmp_path: Path, model_dir: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "daemon.toml"
    config.write_text(
        'listen = "127.0.0.1:0"\n'
        f'state_dir = "{tmp_path / "state"}"\n'
        "[planner]\ninterval_s = 0\n"
        f'[[models]]\nname = "mixtral"\nhf_config = "{model_dir}"\n'
    )
    return subprocess.run(
        [sys.executable, "-m", "fleetshift_daemon.main", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_daemon_refuses_at_start_a_config_json_missing_a_key_naming_it(
    tmp_path: Path,
) -> None:
    cfg = transformers.MixtralConfig(**MIXTRAL_8X7B).to_dict()
    del cfg["num_experts_per_tok"]
    model_dir = _write_model_dir(tmp_path / "mixtral", cfg)
    done = _start_daemon(tmp_path, model_dir)
    assert done.returncode == 2, done.stderr
    assert "num_experts_per_tok" in done.stderr
    assert str(model_dir / "config.json") in done.stderr
    assert not (tmp_path / "state" / "fleetshift.db").exists()  # stopped before any database


def test_the_daemon_refuses_at_start_a_model_type_it_does_not_read(tmp_path: Path) -> None:
    cfg = {**transformers.MixtralConfig(**MIXTRAL_8X7B).to_dict(), "model_type": "jamba"}
    done = _start_daemon(tmp_path, _write_model_dir(tmp_path / "jamba", cfg))
    assert done.returncode == 2, done.stderr
    assert "model_type 'jamba'" in done.stderr


def test_a_model_directory_reads_as_the_mixture_of_experts_it_is(tmp_path: Path) -> None:
    cfg = transformers.MixtralConfig(**MIXTRAL_8X7B).to_dict()
    model_dir = _write_model_dir(tmp_path / "mixtral", cfg)
    arch = model_arch(ModelConfig(name="mixtral", hf_config=str(model_dir)))
    assert arch.name == "mixtral" and arch.family == "mixtral"
    assert arch.moe is not None and arch.moe.n_experts == 8
    assert arch.param_count() == 46_702_792_704  # Hugging Face's count of Mixtral-8x7B


@pytest.mark.parametrize("tied", [False, True])
def test_the_daemon_counts_the_reference_engines_model_as_the_engine_builds_it(
    tied: bool,
) -> None:
    cfg = EngineModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        engine = LlamaModel(cfg)
    built = sum(p.numel() for p in engine.parameters())
    assert ModelArch.from_hf_config("ref", cfg.to_hf()).param_count() == built
