"""A generation session and its portable form.

The portable form (``SessionExport``) is everything needed to continue a session elsewhere:
the token history, how many of those tokens have KV, the sampling parameters and the random
generator's state, and optionally the KV itself. It is serialised as one safetensors blob
(tensors plus a JSON header), so nothing in it is ever executed.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fleetshift_agent.engine.sampling import SamplingParams, new_generator
from fleetshift_common.errors import InvalidArgument


class SessionState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Session:
    session_id: str
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    params: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    generator: torch.Generator = field(default_factory=torch.Generator)
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    state: SessionState = SessionState.WAITING
    finish_reason: str = ""
    created_at: float = 0.0
    last_token_at: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def pending(self) -> int:
        """Tokens to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.cached

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "tokens": list(self.tokens),
            "prompt_len": self.prompt_len,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "seed": self.params.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "cached": self.cached,
            "state": self.state.value,
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_description(cls, d: dict[str, Any], rng_state: torch.Tensor) -> Session:
        try:
            return cls._from_description(d, rng_state)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise InvalidArgument(f"malformed session description: {exc!r}", field="blob") from exc

    @classmethod
    def _from_description(cls, d: dict[str, Any], rng_state: torch.Tensor) -> Session:
        params = SamplingParams(
            temperature=float(d["temperature"]), top_p=float(d["top_p"]), seed=int(d["seed"])
        )
        gen = new_generator(params.seed)
        gen.set_state(rng_state.to(device="cpu", dtype=torch.uint8).clone())  # own storage
        return cls(
            session_id=str(d["session_id"]),
            tokens=[int(t) for t in d["tokens"]],
            prompt_len=int(d["prompt_len"]),
            max_new_tokens=int(d["max_new_tokens"]),
            params=params,
            stop_token_ids=tuple(int(t) for t in d["stop_token_ids"]),
            generator=gen,
            state=SessionState(d["state"]),
            finish_reason=str(d.get("finish_reason", "")),
        )


_META = "fleetshift.session"
_PLATFORM = "fleetshift.platform"


@dataclass
class SessionExport:
    """A session lifted out of an engine; ``k``/``v`` are [layers, cached, kv_heads, head_dim]."""

    description: dict[str, Any]
    rng_state: torch.Tensor
    platform: dict[str, Any]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def has_kv(self) -> bool:
        return self.k is not None

    def to_bytes(self) -> bytes:
        tensors = {"rng_state": self.rng_state.contiguous()}
        if self.k is not None and self.v is not None:
            tensors["k"] = self.k.contiguous()
            tensors["v"] = self.v.contiguous()
        meta = {_META: json.dumps(self.description), _PLATFORM: json.dumps(self.platform)}
        return bytes(st_save(tensors, metadata=meta))

    @classmethod
    def from_bytes(cls, blob: bytes) -> SessionExport:
        try:
            (header_len,) = struct.unpack("<Q", blob[:8])
            header = json.loads(blob[8 : 8 + header_len])
            meta = header.get("__metadata__", {})
            tensors = st_load(blob)
            description = json.loads(meta[_META])
            platform = json.loads(meta[_PLATFORM])
        except Exception as exc:  # safetensors raises its own error type on bad bytes
            raise InvalidArgument(f"not a session blob: {exc}", field="blob") from exc
        if "rng_state" not in tensors:
            raise InvalidArgument("session blob lacks rng_state", field="blob")
        return cls(
            description=description,
            rng_state=tensors["rng_state"],
            platform=platform,
            k=tensors.get("k"),
            v=tensors.get("v"),
        )
