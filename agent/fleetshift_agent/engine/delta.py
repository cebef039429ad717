"""The final delta of a live move: what changed in a session since a pre-copied base.

A live move copies a session's KV while it keeps decoding (the base, N tokens), stages that
copy at the target, and stops the source only to carry what changed since: the new tokens,
the random generator's state and the KV from the block that held the base's last position on.
KV of earlier positions never changes (a preempted session recomputes the very same bits), so
the delta is a few blocks whatever the context length, and the pause a client sees is too.

The delta names its base by token count and a digest of the base's tokens, so a delta applied
to any other staged copy is refused by field before anything changes. A staged copy holds KV
blocks but is not a live session: it is not scheduled, has no client stream, and snapshots
leave it out (the move it belongs to is not finished).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleetshift_common.errors import FailedPrecondition, InvalidArgument

DELTA_KEY = "delta"


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("q", tokens).tobytes()).hexdigest()


def kv_start(from_token: int, block_size: int) -> int:
    """First position a delta carries: the start of the block holding the base's last token."""
    return ((from_token - 1) // block_size) * block_size


@dataclass(frozen=True)
class DeltaHeader:
    """The ``delta`` part of a delta's description."""

    base_tokens: int
    base_digest: str
    kv_start: int

    def to_json(self) -> dict[str, Any]:
        return {
            "base_tokens": self.base_tokens,
            "base_digest": self.base_digest,
            "kv_start": self.kv_start,
        }

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> DeltaHeader:
        try:
            d = description[DELTA_KEY]
            return cls(int(d["base_tokens"]), str(d["base_digest"]), int(d["kv_start"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed delta header: {exc!r}", field="blob") from exc


def check_base(
    header: DeltaHeader,
    *,
    delta_session: str,
    staged_session: str,
    staged_tokens: Sequence[int],
) -> None:
    """Refuses, naming the field, a delta made against another base than the staged copy."""
    if delta_session != staged_session:
        raise FailedPrecondition(
            f"delta is for session_id {delta_session!r}, not the staged {staged_session!r}",
            field="session_id",
        )
    if header.base_tokens != len(staged_tokens):
        raise FailedPrecondition(
            f"delta starts at from_token {header.base_tokens}, the staged copy holds "
            f"{len(staged_tokens)} tokens",
            field="from_token",
        )
    if header.base_digest != tokens_digest(staged_tokens):
        raise FailedPrecondition(
            "delta was made against other tokens than the staged copy's", field="tokens"
        )
