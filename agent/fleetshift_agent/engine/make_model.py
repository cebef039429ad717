"""Writes a seeded random Llama-style model directory for tests, demos and benchmarks.

Random weights are enough to prove the engine and its snapshots: exactness is about bits, not
about sensible text, and a seeded model is the same on every machine.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from fleetshift_agent.engine.config import ModelConfig
from fleetshift_agent.engine.model import LlamaModel
from fleetshift_agent.engine.tokenizer_file import write_tokenizer
from fleetshift_agent.engine.weights import save_model_dir, torch_dtype

PRESETS: dict[str, ModelConfig] = {
    # ~0.6 MB: unit tests.
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # ~10 MB: loadable by vLLM too (its CPU attention kernels take head sizes of 32 and up,
    # so 64 here where "tiny" has 16); tests/vllm run both engines on it.
    "tiny-vllm": ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    # ~60 MB: demos.
    "small": ModelConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    # ~75 MB: "small"'s sibling of another shape (twice the depth, 3/4 the width, one KV head
    # for six query heads instead of one for two), for fitting on one and predicting the other.
    "small-deep": ModelConfig(
        vocab_size=8000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    ),
    # ~1.4 GB in float32: the benchmark model, sized for a 2-core CPU.
    "bench": ModelConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
}


def random_model(cfg: ModelConfig, seed: int) -> LlamaModel:
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(cfg)
    dtype = torch_dtype(cfg.torch_dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "embed_tokens" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model.to(dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=int, default=1024)
    args = parser.parse_args(argv)
    model = random_model(PRESETS[args.preset], args.seed)
    paths = save_model_dir(model, args.out, shard_bytes=args.shard_mb << 20)
    paths.append(write_tokenizer(args.out, PRESETS[args.preset].vocab_size, args.seed))
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {args.out} ({len(paths)} file(s), {total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
