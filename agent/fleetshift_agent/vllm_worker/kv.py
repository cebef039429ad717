"""When a session's KV may travel between two vLLM workers, and what the record says.

vLLM's disk connector (``ExampleConnector``; FleetShift's ``FleetShiftDiskConnector`` mends
its keys) stores a request's KV in a shared directory, keyed by the request's prompt
tokens, and a second vLLM whose connector reads the same directory injects it into a
request with the same leading tokens instead of computing it.
FleetShift uses exactly that for a move: the source prefills the session's context once
more (its own prefix cache holds it, so only the last partial block is computed), which
stores the KV; the destination starts the session's request with the whole context, and its
connector loads the stored blocks. Only whole vLLM blocks travel; the tail is recomputed.

The KV is read as raw tensors, so it is only taken where the compatibility key agrees
(engine and version, model and weights, dtype, TP degree, GPU product, torch): anything
else would misread it. When it cannot travel the destination recomputes the context from
the session's token history and says why; when it was offered but vLLM loaded none (the
store was emptied, another connector), vLLM's own counter shows it and the answer says so.

Over NIXL (``NixlConnector``) nothing is stored: the source prefills the context with
``do_remote_decode``, its vLLM keeps the blocks and answers where they are, and the
destination's vLLM pulls them over UCX when the session's first request starts there (whole
context, partial last block included). The same key rules apply.
Pure: no HTTP, no files.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.json_format import MessageToDict

from fleetshift.v1 import worker_pb2
from fleetshift_agent.vllm_worker.server import DISK_CONNECTOR, NIXL_CONNECTOR
from fleetshift_agent.vllm_worker.sessions import KvRef

# vLLM's disk connector as FleetShift fixes it (server.DISK_CONNECTOR: upstream's
# ExampleConnector can crash the engine on a prompt of 1 + k blocks, which moves produce).
DISK_CONNECTORS = (DISK_CONNECTOR,)
NO_KV_NOTE = (
    "KV recomputed: a vLLM worker carries a session as its token history (vLLM's prefix "
    "cache reuses what it holds)"
)


def key_fields(key: worker_pb2.WorkerCompatKey) -> dict[str, str | int]:
    """A compatibility key as the JSON a session blob carries."""
    fields: dict[str, str | int] = MessageToDict(key, preserving_proto_field_name=True)
    return fields


def carried_tokens(context_len: int, block_size: int) -> int:
    """How many tokens of a context the disk connector stores and finds again: the whole
    vLLM blocks before the context's last token (at least one token is left to compute)."""
    if block_size <= 0 or context_len <= 1:
        return 0
    return (context_len - 1) // block_size * block_size


# A delta whose session ran on further than this past its pre-copied KV stores its KV
# afresh: the destination would otherwise compute every token after the old export inside
# the pause. Not tuned on any measurement: a fixed bound on the tail a pause may compute (a
# short prefill on a GPU; tens of ms for the tiny CPU model). The executor's catch-up rounds
# go on while deltas carry KV, so a session that decodes fast is caught up to it.
TAIL_TOKENS = 256


def export_carries_kv(
    connector: str, from_token: int, release: bool, paused: bool, context: int
) -> bool:
    """Which exports (ExportSession with_kv) hand the session's KV on, the session's
    ``context`` (prompt + generated) standing where it is.

    On the disk connector, every export but a short delta: a pre-copy stores the context as
    it stands while the session decodes on, and a delta at most ``TAIL_TOKENS`` past it
    carries only tokens, so the pause before the last delta writes no KV whatever the
    context's length; the destination loads the pre-copied blocks and computes the few
    tokens after them. A longer delta stores the KV again.

    Over NIXL, only once the session stands still (the worker paused, or the session
    leaving): the destination pulls at its import, so the offer must be of the final
    context; an offer pins its blocks in the source's vLLM until pulled or its lease ends,
    and one made while the worker still runs (a pre-copy) would never be pulled."""
    if connector == NIXL_CONNECTOR:
        return release or paused
    return not from_token or context - from_token > TAIL_TOKENS


def kv_refusal(
    kv: KvRef | None,
    connector: str,
    store: str,
    key: Mapping[str, str | int],
) -> str:
    """Why this worker (``connector`` reading ``store``, with ``key``) cannot take the KV a
    session carries: a note beginning "KV recomputed", or "" when it can."""
    if kv is None:
        return NO_KV_NOTE + "; the source offered no KV"
    if kv.connector == NIXL_CONNECTOR or connector == NIXL_CONNECTOR:
        return _nixl_refusal(kv, connector) or _key_refusal(kv, key)
    if not store or connector not in DISK_CONNECTORS:
        return "KV recomputed: this worker has no disk KV connector (kv_connector_path)"
    if kv.connector not in DISK_CONNECTORS or kv.store != store:
        return (
            f"KV recomputed: the KV waits in {kv.connector}'s store {kv.store!r}; this worker "
            f"reads {store!r}"
        )
    return _key_refusal(kv, key)


def _nixl_refusal(kv: KvRef, connector: str) -> str:
    """Over NIXL the destination's vLLM pulls from the source's: both must run it."""
    if connector != NIXL_CONNECTOR:
        return (
            f"KV recomputed: the KV waits in {kv.connector} at {kv.store!r}; this worker "
            f"runs {connector or 'no KV connector'}"
        )
    if kv.connector != NIXL_CONNECTOR:
        return f"KV recomputed: the KV waits in {kv.connector}'s store; this worker runs NIXL"
    if not kv.params.get("do_remote_prefill"):
        return "KV recomputed: the blob's NIXL KV carries no transfer parameters"
    return ""


def _key_refusal(kv: KvRef, key: Mapping[str, str | int]) -> str:
    differ = sorted(k for k in set(kv.key) | set(key) if kv.key.get(k) != key.get(k))
    if differ:
        return "KV recomputed: the compatibility key differs in " + ", ".join(differ)
    return ""


def nixl_tokens(params: Mapping[str, object], context_len: int) -> int:
    """How many context tokens NIXL offers: what the source's vLLM says it holds (partial
    blocks travel too), never more than the context."""
    offered = params.get("remote_num_tokens")
    return min(offered, context_len) if isinstance(offered, int) else context_len


STAGED_NOTE = "KV recomputed: staged (the KV is looked up when it starts)"


def staged_note(kv: KvRef, context_len: int, loaded: int) -> str:
    """A staged import's answer: what vLLM loaded ahead, by its own count."""
    if loaded <= 0:
        return (
            f"staged; the KV of {kv.tokens} tokens was offered from {kv.store!r} but vLLM "
            "loaded none ahead (it is looked up again when the session starts)"
        )
    return (
        f"staged; {loaded} of {context_len} context tokens loaded ahead from {kv.store!r} "
        "into vLLM's prefix cache"
    )


def preloaded_note(kv: KvRef, context_len: int, loaded: int) -> str:
    """The final import's answer for a session whose KV vLLM loaded while it was staged,
    by vLLM's own count then. Its start is not counted again: reading vLLM's /metrics
    around it would sit inside the session's pause (14-335 ms a read here). The blocks are
    in vLLM's prefix cache or, evicted meanwhile, in the export's folder, kept until then."""
    return (
        f"KV restored by vLLM's {kv.connector}: {loaded} of {context_len} context tokens "
        f"loaded from {kv.store!r} while the session was staged (vLLM's external "
        f"prefix-cache count then), {max(0, context_len - loaded)} left to compute at its "
        "start (not counted again inside the pause)"
    )


def restored_note(kv: KvRef, context_len: int, loaded: int, local: int) -> str:
    """The import's answer when the KV could travel: what vLLM's counters say it did."""
    computed = max(0, context_len - loaded - local)
    if loaded <= 0:
        return (
            f"KV recomputed: the KV of {kv.tokens} tokens was offered from {kv.store!r} but "
            f"vLLM loaded none (its external prefix-cache hits did not grow); it computed "
            f"{computed} of {context_len} context tokens"
        )
    return (
        f"KV restored by vLLM's {kv.connector}: {loaded} of {context_len} context tokens "
        f"loaded from {kv.store!r}, {local} from the local prefix cache, {computed} computed"
    )
