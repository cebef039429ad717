"""A vLLM worker's sessions: what each asked for, and its portable form for moves.

vLLM holds a request's KV and sampler; FleetShift holds the session around it (prompt,
length, sampling, the tokens generated so far), so a session can outlive one vLLM request:
a move ends the request on the source and the destination starts a new one whose prompt is
the session's whole context. The portable form is JSON (never pickle), opaque to the daemon.

Greedy sessions continue with exactly the tokens an uninterrupted run gives. A seeded
sampled session does not: vLLM seeds a request's generator when the request starts and
advances it once per sampled token, and no API sets a generator's state, so the request a
move (or a pause) starts draws from the seed afresh. What holds, and tests/vllm checks: the
tokens before the move are the uninterrupted run's, and the tokens after it are exactly what
vLLM alone gives for the session's context so far with the same seed (reproducible), not
the uninterrupted run's draws. A Pause ends requests too (the worker holds its sessions), so
the same holds across a Pause and Resume on one worker.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field

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

    def completion(self, generated: list[int], kv: KvRef | None = None) -> Completion:
        """The vLLM request that continues this session after ``generated``; with ``kv``
        (the KV an import carried), the connector loads that KV for it."""
        return Completion(
            prompt=self.prompt + tuple(generated),
            max_tokens=self.max_new_tokens - len(generated),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            # One session may run as several vLLM requests (a pause, a move): never one id twice.
            request_id=f"{self.session_id}-{len(generated)}-{uuid.uuid4().hex[:8]}",
            kv_transfer_params=kv.load_params() if kv is not None else None,
        )

    def kv_completion(self, generated: list[int], params: dict[str, object]) -> Completion:
        """The request that makes the connector export this session's KV: a prefill of its
        whole context, one token long (the token is dropped). ``params``: the disk
        connector's store order under the export's id (``kv_params("store", id)``: the
        destination's request has the same prompt and names the same id, so it finds the KV;
        no other request does), or NIXL's ``do_remote_decode`` (vLLM keeps the blocks and
        answers where to pull them from)."""
        return Completion(
            prompt=self.prompt + tuple(generated),
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            seed=0,
            request_id=f"{self.session_id}-kv-{len(generated)}-{uuid.uuid4().hex[:8]}",
            kv_transfer_params=params,
        )

    def to_blob(
        self, generated: list[int], *, delta: bool = False, kv: KvRef | None = None
    ) -> bytes:
        body = {"format": BLOB_FORMAT, **asdict(self), "generated": generated, "delta": delta}
        if kv is not None:
            body["kv"] = asdict(kv)
        return json.dumps(body).encode()


def kv_params(what: str, export_id: str) -> dict[str, object]:
    """vLLM's kv_transfer_params for FleetShift's connector: store or load this export."""
    return {"fleetshift_kv": what, "fleetshift_kv_id": export_id}


@dataclass(frozen=True)
class KvRef:
    """Where a session's KV waits for its next worker: the store of vLLM's disk connector
    (``ExampleConnector``), holding the KV of the context's first ``tokens`` tokens, written
    by a worker whose compatibility key is ``key`` (the destination takes it only if its own
    key and store agree: otherwise the KV would be misread, not merely slow), under the
    export's ``id`` (kv_store: the folder is single-use, deleted once imported).

    Over NIXL there is no store: ``store`` names the source's side channel (host:port) and
    ``params`` are the parameters the source's vLLM answered (engine id, block ids, side
    channel): the destination's vLLM pulls the blocks with them, once."""

    connector: str
    store: str
    tokens: int
    key: dict[str, str | int] = field(default_factory=dict)
    id: str = ""
    params: dict[str, object] = field(default_factory=dict)

    def load_params(self) -> dict[str, object]:
        """The kv_transfer_params of the request that loads this KV at the destination. A
        disk load names the export's token count: after a pre-copy the request that loads
        it is longer than the context the export holds (the rest is computed)."""
        if self.params:
            return dict(self.params)
        return kv_params("load", self.id) | {"fleetshift_kv_tokens": self.tokens}


@dataclass(frozen=True)
class Carried:
    spec: SessionSpec
    generated: list[int]
    delta: bool
    kv: KvRef | None = None

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
            kv = raw.get("kv")
            ref = None
            if kv is not None:
                key = {str(k): v for k, v in dict(kv["key"]).items()}
                params = kv.get("params") or {}
                if not isinstance(params, dict):
                    raise TypeError(f"kv.params is a {type(params).__name__}, not an object")
                ref = KvRef(
                    str(kv["connector"]), str(kv["store"]), int(kv["tokens"]), key,
                    str(kv.get("id", "")), {str(k): v for k, v in params.items()},
                )  # fmt: skip
            return cls(spec, generated, bool(raw.get("delta", False)), ref)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidArgument(
                f"blob is not a vLLM worker's session ({err}); sessions move only between "
                "workers of the same engine",
                field="blob",
            ) from None
