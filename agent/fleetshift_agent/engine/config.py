"""Model and engine settings as frozen values.

The model settings come from a Hugging Face ``config.json`` so that a directory written by any
Llama exporter loads unchanged; the engine settings are ours. Both are part of what a snapshot
records, so they are plain values that round-trip through JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleetshift_common.errors import InvalidArgument

ENGINE_NAME = "fleetshift-ref"
ENGINE_VERSION = "0.1.0"

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "float32"
    head_dim: int = 0  # 0: hidden_size // num_attention_heads

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(
                "num_attention_heads must be a multiple of num_key_value_heads",
                field="num_key_value_heads",
            )
        if self.head_dim % 2:
            raise InvalidArgument("head_dim must be even for RoPE", field="head_dim")
        if self.torch_dtype not in _DTYPES:
            raise InvalidArgument(
                f"torch_dtype {self.torch_dtype!r} unsupported", field="torch_dtype"
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Reads the LlamaConfig keys; unknown keys are ignored, missing required ones named."""
        if raw.get("rope_scaling"):
            raise InvalidArgument("rope_scaling is not supported", field="rope_scaling")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        for name in required:
            if name not in raw:
                raise InvalidArgument(f"config.json lacks {name}", field=name)
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        values.setdefault("num_key_value_heads", raw["num_attention_heads"])
        return cls(**values)

    @classmethod
    def load(cls, model_dir: Path) -> ModelConfig:
        path = model_dir / "config.json"
        if not path.is_file():
            raise InvalidArgument(f"{path} does not exist", field="model_dir")
        return cls.from_hf(json.loads(path.read_text()))

    def to_hf(self) -> dict[str, Any]:
        out = asdict(self)
        out["architectures"] = ["LlamaForCausalLM"]
        out["model_type"] = "llama"
        return out


def compile_enabled_by_env(default: bool) -> bool:
    """``FLEETSHIFT_COMPILE=0`` turns compilation off whatever the config says."""
    value = os.environ.get("FLEETSHIFT_COMPILE")
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Capacity settings never change a session's tokens.

    ``rows`` is the fixed row count of every matrix product: a token's numbers never depend on
    what else is in the batch because every product has the same shape. ``rows``, ``dtype``,
    ``device`` and ``compile`` do change the numbers, so KV is only reused by an engine whose
    settings match (``Engine.platform``); otherwise it is recomputed from the tokens.
    """

    block_size: int = 16
    num_blocks: int = 256
    max_running: int = 16
    max_step_tokens: int = 256
    rows: int = 16
    compile: bool = False
    device: str = "cpu"
    dtype: str = ""  # empty: the model's torch_dtype

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_running", "max_step_tokens", "rows"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive", field=name)
        if self.dtype and self.dtype not in _DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} unsupported", field="dtype")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> EngineConfig:
        return cls(**raw)
