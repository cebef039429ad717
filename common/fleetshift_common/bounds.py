"""The bounds of every number a FleetShift API accepts, in one table.

A request field without a bound is a lever: one Route call with ``prompt_tokens = 2**63 - 1``
once moved the traffic window's mean to ~6e16 tokens and made the planner retire every worker.
Each bound here is derived from what the number stands for (a model's context, a node's GPUs,
an SLO in milliseconds, a file's size) and written down with its reason, so it can be checked
at the boundary of every service (``fleetshift_rpc.validation`` walks each request against this
table) and documented in one place (``docs/api-bounds.md``).

The table is keyed by the protobuf field's full name (``fleetshift.v1.RouteRequest.prompt_tokens``)
but this module imports no protobuf: it is pure data and the checks on plain values. A field of
a request message that has no entry fails ``tests/test_api_bounds.py``, so a new field cannot
be added without deciding its bound.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass

from fleetshift_common.errors import InvalidArgument

# Physical scales the bounds are derived from.
# Recently finished sessions a worker reports (and its agent relays) per heartbeat: the last
# this many, so a heartbeat stays small however fast sessions finish.
MAX_FINISHED_SESSIONS = 256
MAX_CONTEXT_TOKENS = 1 << 20  # 1,048,576: the longest context of any model served (per-model
# limits, from the model's own config, are tighter; see fleetshift_daemon.core.validation)
MAX_GPUS_PER_NODE = 64  # the registry's own limit on one node's inventory
MAX_TENSOR_PARALLEL = MAX_GPUS_PER_NODE  # a worker runs on the GPUs of one node
MAX_TOKEN_ID = (1 << 31) - 1  # vocabularies are far smaller; ids are int32 in every engine
MAX_COUNTER_TOKENS = 1 << 53  # cumulative counters; exact as a float (the window sums them)
MAX_LATENCY_MS = 86_400_000.0  # one day: a latency figure beyond it is not a latency
MAX_TTFT_SLO_MS = 3_600_000.0  # one hour to the first token
MAX_TBT_SLO_MS = 60_000.0  # one minute between tokens
MIN_SLO_MS = 0.001  # one microsecond: below any achievable latency, but > 0
MAX_SNAPSHOT_BYTES = 1 << 50  # 1 PiB: far beyond any snapshot a node can hold
MAX_CHUNK_BYTES = 64 << 20  # the transfer's chunk cap is smaller still; 0 = server default
MAX_TEXT_CHARS = 4096  # PATH_MAX: the longest string field (a path) any request needs
MAX_ITEMS = 65_536  # default cap on a repeated field's length
MAX_ROUTE_BATCH = 4096  # Route requests in one RouteStream message (~100 bytes each)
# Tokens one GenerateResponse may carry (tokens_per_message): a message stays a few KiB, and
# a client's view of progress no coarser than this.
MAX_TOKENS_PER_MESSAGE = 256


@dataclass(frozen=True)
class Bound:
    """``lo <= value <= hi`` (``lo < value`` when ``lo_open``), or exactly 0 when ``zero``
    says what proto3's unset 0 means for this field."""

    lo: float
    hi: float
    unit: str
    why: str
    zero: str = ""
    lo_open: bool = False
    max_items: int = MAX_ITEMS  # for a repeated field: how many values at most

    def describe(self) -> str:
        lo = _number(self.lo)
        low = f"> {lo}" if self.lo_open else f">= {lo}"
        text = f"{low} and <= {_number(self.hi)} {self.unit}".rstrip()
        return f"{text} (0: {self.zero})" if self.zero else text

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if value == 0 and self.zero:
            return True
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and value <= self.hi


def _number(value: float) -> str:
    if float(value).is_integer():
        return f"{int(value):,}".replace(",", "_") if abs(value) >= 100_000 else str(int(value))
    return f"{value:g}"


def check(path: str, value: float, bound: Bound) -> None:
    """Raise InvalidArgument naming the field (``path``, e.g. ``gpus[0].index``) and the bound."""
    if not bound.admits(value):
        raise InvalidArgument(
            f"{path} must be {bound.describe()}, got {value!r}", field=path.split("[")[0]
        )


def check_items(path: str, count: int, bound: Bound | int) -> None:
    limit = bound if isinstance(bound, int) else bound.max_items
    if count > limit:
        raise InvalidArgument(
            f"{path} lists {count} values, the limit is {limit}", field=path.split("[")[0]
        )


def check_text(path: str, text: str, limit: int = MAX_TEXT_CHARS) -> None:
    if len(text) > limit:
        raise InvalidArgument(
            f"{path} is {len(text)} characters long, the limit is {limit}",
            field=path.split("[")[0],
        )


def check_host_port(path: str, address: str) -> None:
    """An address another process will dial: ``host:port`` with a port of 1 to 65535, refused
    here rather than after seconds of name resolution and reconnect backoff."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(
            f"{path} must be host:port with a port of 1 to 65535, got {address!r}", field=path
        )


_V = "fleetshift.v1."
_GPU_INDEX = Bound(
    0,
    MAX_GPUS_PER_NODE - 1,
    "",
    f"a GPU of a node ({MAX_GPUS_PER_NODE} at most)",
    max_items=MAX_GPUS_PER_NODE,
)
_TP = Bound(
    1,
    MAX_TENSOR_PARALLEL,
    "GPUs",
    "a worker spans the GPUs of one node",
    zero="chosen from the model's options",
)
_TOKENS_SO_FAR = Bound(0, MAX_CONTEXT_TOKENS, "tokens", "a position inside a context")
_COUNT_TOKENS = Bound(0, MAX_COUNTER_TOKENS, "tokens", "a cumulative counter, exact as a float")
_LATENCY = Bound(0, MAX_LATENCY_MS, "ms", "a measured latency percentile")
_BLOCKS = Bound(0, 1 << 24, "blocks", "16 Mi KV blocks: more than any GPU holds")
_SESSIONS = Bound(0, 1 << 20, "", "requests or sessions one worker holds")

BOUNDS: Mapping[str, Bound] = types.MappingProxyType(
    {
        # fleet.proto (agents register and heartbeat)
        _V + "Gpu.index": _GPU_INDEX,
        _V + "Gpu.memory_bytes": Bound(1 << 30, 1 << 40, "bytes", "1 GiB to 1 TiB of GPU memory"),
        _V + "Gpu.nvlink_peers": _GPU_INDEX,
        _V + "WorkerStatus.tensor_parallel": _TP,
        _V + "WorkerStatus.gpu_indices": _GPU_INDEX,
        _V + "WorkerStatus.role_epoch": Bound(0, 1 << 53, "", "a count of role changes"),
        _V + "FinishedSession.prompt_tokens": Bound(
            1, MAX_CONTEXT_TOKENS, "tokens", "a prompt fits the model's context"
        ),
        _V + "FinishedSession.output_tokens": Bound(
            0, MAX_CONTEXT_TOKENS, "tokens", "an output fits the model's context"
        ),
        _V + "WorkerCounters.prefill_tokens": _COUNT_TOKENS,
        _V + "WorkerCounters.decode_tokens": _COUNT_TOKENS,
        _V + "WorkerCounters.queue_depth": _SESSIONS,
        _V + "WorkerCounters.kv_blocks_used": _BLOCKS,
        _V + "WorkerCounters.kv_blocks_total": _BLOCKS,
        _V + "WorkerCounters.live_sessions": _SESSIONS,
        _V + "WorkerCounters.ttft_p50_ms": _LATENCY,
        _V + "WorkerCounters.ttft_p99_ms": _LATENCY,
        _V + "WorkerCounters.tbt_p50_ms": _LATENCY,
        _V + "WorkerCounters.tbt_p99_ms": _LATENCY,
        # placement.proto (the fleet's router and scheduler, operators)
        _V + "RouteRequest.prompt_tokens": Bound(
            1, MAX_CONTEXT_TOKENS, "tokens", "a prompt fits the model's context"
        ),
        _V + "RouteRequest.expected_output_tokens": Bound(
            1, MAX_CONTEXT_TOKENS, "tokens", "an output fits the model's context"
        ),
        _V + "RouteStreamItem.id": Bound(
            0, (1 << 64) - 1, "", "the caller's own request id, only echoed in the answer"
        ),
        _V + "Slo.ttft_ms": Bound(
            MIN_SLO_MS, MAX_TTFT_SLO_MS, "ms", "time to first token", zero="the model's SLO"
        ),
        _V + "Slo.tbt_ms": Bound(
            MIN_SLO_MS, MAX_TBT_SLO_MS, "ms", "time between tokens", zero="the model's SLO"
        ),
        _V + "PlaceWorkerRequest.tensor_parallel": _TP,
        _V + "GetEfficiencyRequest.history": Bound(
            1, 1000, "samples", "the history the daemon keeps in memory", zero="20"
        ),
        # operations.proto (operators)
        _V + "StartFleetWorkerRequest.tensor_parallel": _TP,
        _V + "StartFleetWorkerRequest.gpu_indices": _GPU_INDEX,
        _V + "MoveWorkerRequest.target_gpus": _GPU_INDEX,
        _V + "ListOperationsRequest.limit": Bound(
            1, 1000, "operations", "one page of the audit history", zero="50"
        ),
        # agent.proto (the daemon drives agents)
        _V + "StartWorkerRequest.tensor_parallel": Bound(
            1, MAX_TENSOR_PARALLEL, "GPUs", "the GPUs of one node", zero="len(gpu_indices)"
        ),
        _V + "StartWorkerRequest.gpu_indices": _GPU_INDEX,
        _V + "StopWorkerRequest.grace_s": Bound(
            0, 3600, "s", "SIGTERM to SIGKILL within an hour", zero="5 s"
        ),
        # snapshot.proto (agents pull from agents)
        _V + "ReadSnapshotRequest.offset": Bound(
            0, MAX_SNAPSHOT_BYTES, "bytes", "a position in a snapshot file"
        ),
        _V + "ReadSnapshotRequest.chunk_size": Bound(
            1, MAX_CHUNK_BYTES, "bytes", "one chunk in one message", zero="the server's default"
        ),
        _V + "SnapshotCompatKey.gpu_count": Bound(
            0, MAX_GPUS_PER_NODE, "GPUs", "the GPUs of one node"
        ),
        _V + "SnapshotCompatKey.tensor_parallel": Bound(
            0, MAX_TENSOR_PARALLEL, "GPUs", "the GPUs of one node"
        ),
        # worker.proto (clients and the agent drive a worker)
        _V + "GenerateRequest.prompt_tokens": Bound(
            0, MAX_TOKEN_ID, "", "a token id", max_items=MAX_CONTEXT_TOKENS
        ),
        _V + "GenerateRequest.max_new_tokens": Bound(
            1,
            MAX_CONTEXT_TOKENS,
            "tokens",
            "an output fits a context",
            zero="only when resuming a session",
        ),
        _V + "GenerateRequest.stop_token_ids": Bound(
            0, MAX_TOKEN_ID, "", "a token id", max_items=1024
        ),
        _V + "GenerateRequest.resume_from_token": _TOKENS_SO_FAR,
        _V + "GenerateRequest.hold_after_tokens": _TOKENS_SO_FAR,
        _V + "GenerateRequest.tokens_per_message": Bound(
            0, MAX_TOKENS_PER_MESSAGE, "tokens", "one message stays small", zero="one per message"
        ),
        _V + "WorkerSampling.temperature": Bound(0, 100, "", "a softmax temperature"),
        _V + "WorkerSampling.top_p": Bound(0, 1, "", "a probability mass", lo_open=True),
        _V + "WorkerSampling.seed": Bound(0, (1 << 64) - 1, "", "any 64-bit seed"),
        _V + "WorkerResumeRequest.steps": Bound(0, 1_000_000, "steps", "single-stepping an engine"),
        _V + "ExportSessionRequest.from_token": _TOKENS_SO_FAR,
    }
)

# Repeated message fields whose length has a meaning of its own (others: MAX_ITEMS).
MAX_REPEATED: Mapping[str, int] = types.MappingProxyType(
    {
        _V + "RegisterNodeRequest.gpus": MAX_GPUS_PER_NODE,
        _V + "HeartbeatRequest.workers": 256,
        _V + "WorkerStatus.session_ids": 1 << 20,
        _V + "WorkerStatus.finished_sessions": MAX_FINISHED_SESSIONS,
        _V + "RouteStreamRequest.requests": MAX_ROUTE_BATCH,
    }
)

MAX_PROFILE_CHARS = 16 << 20  # a profile CSV (one row per measurement) or a config.json

# String fields that may be longer than MAX_TEXT_CHARS (bytes fields are bounded by the message
# size limit alone): an uploaded profile and its model's config are documents, not names.
MAX_TEXT: Mapping[str, int] = types.MappingProxyType(
    {
        _V + "UploadCalibrationRequest.profile_csv": MAX_PROFILE_CHARS,
        _V + "UploadCalibrationRequest.model_config_json": MAX_PROFILE_CHARS,
    }
)
