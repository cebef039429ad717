"""Greedy and seeded sampling, with the random stream owned by the session.

Each session draws from its own CPU ``torch.Generator``: its state is a byte tensor that
travels with the session, so a restored session draws the very numbers it would have drawn,
whatever device or batch it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetshift_common.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidArgument("temperature must be >= 0", field="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p must be in (0, 1]", field="top_p")
        if not 0 <= self.seed < 2**63:
            raise InvalidArgument("seed must be in [0, 2^63)", field="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def new_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """logits: [vocab] float32 on CPU."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(before < params.top_p, sorted_probs, 0.0)
        pick = torch.multinomial(sorted_probs, 1, generator=gen)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=gen))
