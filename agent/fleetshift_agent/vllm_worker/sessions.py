"""A vLLM worker's sessions: what each asked for, and its portable form for moves.

vLLM holds a request's KV and sampler; FleetShift holds the session around it (prompt,
length, sampling, the tokens generated so far), so a session can outlive one vLLM request:
a move ends the request on the source and the destination starts a new one whose prompt is
the session's whole context. The portable form is JSON (never pickle), opaque to the daemon.

Greedy sessions continue with exactly the tokens an uninterrupted run gives. A seeded
sampled session continues with vLLM's per-request generator seeded again at the move, so its
tokens after the move are a valid draw from the same distribution but not the tokens the
uninterrupted run would have drawn (tests/vllm states and checks this).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fleetshift_agent.vllm_worker.client import Completion
from fleetshift_common.errors import InvalidArgument

BLOB_FORMAT = "fleetshift-vllm-session/1"


@dataclass(frozen=True)
class SessionSpec:
    session_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...] = ()

    def completion(self, generated: list[int]) -> Completion:
        """The vLLM request that continues this session after ``generated``."""
        return Completion(
            prompt=self.prompt + tuple(generated),
            max_tokens=self.max_new_tokens - len(generated),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            request_id=f"{self.session_id}-{len(generated)}",
        )

    def to_blob(self, generated: list[int], *, delta: bool = False) -> bytes:
        body = {"format": BLOB_FORMAT, **asdict(self), "generated": generated, "delta": delta}
        return json.dumps(body).encode()


@dataclass(frozen=True)
class Carried:
    spec: SessionSpec
    generated: list[int]
    delta: bool

    @classmethod
    def from_blob(cls, blob: bytes) -> Carried:
        try:
            raw = json.loads(blob)
            if raw.get("format") != BLOB_FORMAT:
                raise ValueError(f"format {raw.get('format')!r} is not {BLOB_FORMAT!r}")
            spec = SessionSpec(
                session_id=str(raw["session_id"]),
                prompt=tuple(int(t) for t in raw["prompt"]),
                max_new_tokens=int(raw["max_new_tokens"]),
                temperature=float(raw["temperature"]),
                top_p=float(raw["top_p"]),
                seed=int(raw["seed"]),
                stop_token_ids=tuple(int(t) for t in raw["stop_token_ids"]),
            )
            generated = [int(t) for t in raw["generated"]]
            return cls(spec, generated, bool(raw.get("delta", False)))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidArgument(
                f"blob is not a vLLM worker's session ({err}); sessions move only between "
                "workers of the same engine",
                field="blob",
            ) from None
