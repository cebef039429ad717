"""Reading and writing Hugging Face style model directories, never through pickle.

The weights digest is a SHA-256 over the safetensors files (sorted by name, each preceded by
its name and size) so that two directories holding the same bytes agree, and it goes into the
compatibility key of every snapshot made from them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fleetshift_agent.engine.config import ModelConfig
from fleetshift_agent.engine.model import LlamaModel
from fleetshift_common.errors import InvalidArgument

_CHUNK = 8 << 20


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"no *.safetensors in {model_dir}", field="model_dir")
    return files


def weights_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for path in weight_files(model_dir):
        h.update(f"{path.name}:{path.stat().st_size}\n".encode())
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
    return h.hexdigest()


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def read_tensors(model_dir: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def build_model(
    cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], *, dtype: str, device: str
) -> LlamaModel:
    """Assigns the given tensors to a model skeleton, naming any missing or misshapen tensor."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    expected = model.own_tensors()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise InvalidArgument(
            f"weights lack {missing[0]} ({len(missing)} missing)", field=missing[0]
        )
    target = torch_dtype(dtype)
    state: dict[str, torch.Tensor] = {}
    for name, meta in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(meta.shape):
            raise InvalidArgument(
                f"{name} has shape {tuple(t.shape)}, config wants {tuple(meta.shape)}", field=name
            )
        state[name] = t.to(device=device, dtype=target)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()


def load_model_dir(model_dir: Path, *, dtype: str = "", device: str = "cpu") -> LlamaModel:
    cfg = ModelConfig.load(model_dir)
    return build_model(cfg, read_tensors(model_dir), dtype=dtype or cfg.torch_dtype, device=device)


def save_model_dir(model: LlamaModel, out: Path, *, shard_bytes: int = 2 << 30) -> list[Path]:
    """Writes config.json and the weights, sharded with an index like Hugging Face does."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in model.own_tensors().items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        path = out / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        weight_map.update({k: path.name for k in shard})
        paths.append(path)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return paths
