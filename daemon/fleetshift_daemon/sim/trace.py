"""Request traces (Azure CSV or Mooncake JSON lines), and the ways the simulator reshapes them.

A placement decision only needs the shape of each request (when, how long a prompt, how many
tokens out), so a trace is three numpy columns. ``load_trace`` takes either format an operator
is likely to hold, chosen by extension (``.csv``; ``.jsonl`` / ``.ndjson`` / ``.json``) or,
for any other name, by the first character of the file (``{`` means JSON lines):

* any CSV with the three Azure columns ``TIMESTAMP,ContextTokens,GeneratedTokens``;
* the Mooncake trace format (FAST'25 release): one JSON object per line with ``timestamp``
  (milliseconds from the start), ``input_length``, ``output_length`` and optionally
  ``hash_ids`` (the prompt's 512-token block hashes). ``hash_ids`` are kept on the trace
  (``Trace.hash_ids``) for prefix-reuse studies; the simulator does not use them yet (it has
  no prefix cache), so every prompt is prefilled in full.

A malformed file is refused with the line and column (field) at fault, never half-loaded.
A model cannot serve a request longer than its context window; ``fit_context`` removes those
requests and counts them (a server refuses them: vLLM answers such a request with an error)
so a report can say how many were refused.

Reshaping keeps what is real and says what is synthetic:

* ``rate_scaled(x)`` keeps the trace's duration and its drift over time but multiplies the
  arrival rate: every request is replayed ``floor(x)`` times plus once more with probability
  ``frac(x)`` (seeded), each replica shifted by a uniform jitter of at most half a second so
  copies do not arrive as one burst. ``x < 1`` thins the trace the same way.
* ``time_compressed(y)`` divides every timestamp by ``y``: the same requests in ``1/y`` of the
  time, so both the rate and the speed at which the mix moves go up by ``y``.
* ``shifting_mix`` keeps the real arrival times but, phase by phase, draws each request's
  shape from the subset of the real trace that fits the phase (prefill-heavy: prompt/output
  ratio at or above the trace's median; decode-heavy: below it) and scales it.
"""

from __future__ import annotations

import csv
import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetshift_common.errors import InvalidArgument

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
MOONCAKE_BLOCK_TOKENS = 512  # one hash id per 512-token block of the prompt
_REPLICA_JITTER_S = 0.5

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
ObjectArray = npt.NDArray[np.object_]


class TraceFormatError(InvalidArgument):
    """A trace file that is neither an Azure CSV nor Mooncake JSON lines; names line and column."""

    def __init__(self, path: Path, line: int, column: str, why: str) -> None:
        super().__init__(f"{path}: line {line}, column {column}: {why}", field=column)
        self.line = line
        self.column = column


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests sorted by arrival; arrival times in seconds from the first request.

    ``hash_ids``, when the source had them (Mooncake), holds per request an int64 array of the
    prompt's block hashes; every reshaping that keeps request shapes keeps them aligned.
    """

    arrival_s: FloatArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    hash_ids: ObjectArray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise InvalidArgument("trace columns differ in length", field="trace")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise InvalidArgument("trace hash_ids differ in length", field="hash_ids")

    def take(self, idx: IntArray | slice, arrival: FloatArray | None = None) -> Trace:
        """The requests at ``idx`` (in that order), optionally with new arrival times."""
        hashes = None if self.hash_ids is None else self.hash_ids[idx]
        times = self.arrival_s[idx] if arrival is None else arrival
        return Trace(times, self.prompt_tokens[idx], self.output_tokens[idx], hashes)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def window(self, start_s: float, end_s: float) -> Trace:
        """The requests arriving in ``[start_s, end_s)``, times kept."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return self.take(slice(int(lo), int(hi)))

    def head(self, n: int) -> Trace:
        return self.take(slice(0, n))

    def shifted(self, offset_s: float) -> Trace:
        """The same requests with every arrival moved by ``offset_s``."""
        return Trace(
            self.arrival_s + offset_s, self.prompt_tokens, self.output_tokens, self.hash_ids
        )

    def rate_scaled(self, factor: float, seed: int) -> Trace:
        if not factor > 0 or not math.isfinite(factor):
            raise InvalidArgument(f"rate scale must be > 0, got {factor}", field="rate_scale")
        if factor == 1.0:
            return self
        rng = np.random.default_rng(seed)
        whole = math.floor(factor)
        copies = np.full(len(self), whole, dtype=np.int64)
        copies += rng.random(len(self)) < (factor - whole)
        idx = np.repeat(np.arange(len(self)), copies)
        first = np.ones(len(idx), dtype=bool)
        first[1:] = idx[1:] != idx[:-1]
        jitter = np.where(first, 0.0, rng.uniform(-_REPLICA_JITTER_S, _REPLICA_JITTER_S, len(idx)))
        arrival = np.clip(self.arrival_s[idx] + jitter, 0.0, self.duration_s)
        return _sorted(self.take(idx, arrival))

    def time_compressed(self, factor: float) -> Trace:
        if not factor > 0 or not math.isfinite(factor):
            raise InvalidArgument(f"time compression must be > 0, got {factor}", field="time")
        return Trace(self.arrival_s / factor, self.prompt_tokens, self.output_tokens, self.hash_ids)


def _sorted(trace: Trace) -> Trace:
    order = np.argsort(trace.arrival_s, kind="stable")
    return trace.take(order)


@dataclass(frozen=True)
class WindowFit:
    """A trace cut to what a model's context window can serve, and how many were refused."""

    trace: Trace
    refused: int
    window_tokens: int


def fit_context(trace: Trace, window_tokens: int) -> WindowFit:
    """Refuse (remove) requests whose prompt + output exceeds the window, and count them.

    Refusing rather than truncating is what a server does (vLLM rejects a request longer than
    ``max_model_len``), and it keeps every replayed request's shape real.
    """
    if window_tokens < 1:
        raise InvalidArgument(f"context window must be >= 1, got {window_tokens}", field="window")
    keep = np.flatnonzero(trace.prompt_tokens + trace.output_tokens <= window_tokens)
    return WindowFit(trace.take(keep), len(trace) - len(keep), window_tokens)


def _parse_time(text: str) -> float:
    """Seconds: a plain number is taken as seconds, otherwise an ISO-8601 date-time."""
    try:
        return float(text)
    except ValueError:
        pass
    stamp = text.strip()
    if "." in stamp:  # Azure writes 7 fractional digits; datetime takes at most 6
        head, frac = stamp.rsplit(".", 1)
        if frac.isdigit():
            stamp = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(stamp).timestamp()


def is_jsonl(path: Path) -> bool:
    """JSON lines by extension; for any other name, when the first non-blank byte is ``{``."""
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return True
    if suffix == ".csv":
        return False
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"{")


def load_trace(path: str | Path) -> Trace:
    """Read an Azure-format CSV or a Mooncake-format JSON-lines trace (see the module doc)."""
    path = Path(path)
    return load_jsonl_trace(path) if is_jsonl(path) else load_csv_trace(path)


def load_csv_trace(path: str | Path) -> Trace:
    """Read a CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens (others ignored)."""
    path = Path(path)
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(path, 1, "header", "empty file")
        header = [h.strip() for h in header]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise TraceFormatError(path, 1, missing[0], "missing column in header")
        cols = [header.index(c) for c in COLUMNS]
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < len(header):
                raise TraceFormatError(
                    path, line, COLUMNS[0], f"{len(row)} fields, expected {len(header)}"
                )
            times.append(_field_time(path, line, row[cols[0]]))
            prompts.append(_field_int(path, line, COLUMNS[1], row[cols[1]], minimum=1))
            outputs.append(_field_int(path, line, COLUMNS[2], row[cols[2]], minimum=1))
    if not times:
        raise TraceFormatError(path, 2, COLUMNS[0], "no requests")
    return _from_columns(times, prompts, outputs, None)


def _from_columns(
    times: list[float], prompts: list[int], outputs: list[int], hashes: list[IntArray] | None
) -> Trace:
    arrival = np.asarray(times, dtype=np.float64)
    arrival -= arrival.min()
    hash_col = None
    if hashes is not None:
        hash_col = np.empty(len(hashes), dtype=object)
        hash_col[:] = hashes
    trace = Trace(
        arrival,
        np.asarray(prompts, dtype=np.int64),
        np.asarray(outputs, dtype=np.int64),
        hash_col,
    )
    return _sorted(trace)


def load_jsonl_trace(path: str | Path) -> Trace:
    """Read Mooncake JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length``,
    optional ``hash_ids`` (all lines or none); other keys are ignored."""
    path = Path(path)
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    hashes: list[IntArray] = []
    with_hashes: bool | None = None
    with path.open() as fh:
        for line, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            row = _json_object(path, line, text)
            missing = [f for f in MOONCAKE_FIELDS if f not in row]
            if missing:
                raise TraceFormatError(path, line, missing[0], "missing field")
            times.append(_json_number(path, line, "timestamp", row["timestamp"]) / 1000.0)
            prompts.append(_json_int(path, line, "input_length", row["input_length"], 1))
            outputs.append(_json_int(path, line, "output_length", row["output_length"], 1))
            has = "hash_ids" in row
            if with_hashes is None:
                with_hashes = has
            elif has != with_hashes:
                why = "missing field" if with_hashes else "present here but not on line 1"
                raise TraceFormatError(path, line, "hash_ids", why)
            if has:
                hashes.append(_json_hashes(path, line, row["hash_ids"]))
    if not times:
        raise TraceFormatError(path, 1, "timestamp", "no requests")
    return _from_columns(times, prompts, outputs, hashes if with_hashes else None)


def _json_object(path: Path, line: int, text: str) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise TraceFormatError(path, line, "json", f"not JSON: {exc}") from None
    if not isinstance(row, dict):
        raise TraceFormatError(path, line, "json", f"expected an object, got {type(row).__name__}")
    return row


def _json_number(path: Path, line: int, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFormatError(path, line, field, f"not a number: {value!r}")
    if not math.isfinite(value) or value < 0:
        raise TraceFormatError(path, line, field, f"must be finite and >= 0, got {value!r}")
    return float(value)


def _json_int(path: Path, line: int, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(path, line, field, f"not an integer: {value!r}")
    if value < minimum:
        raise TraceFormatError(path, line, field, f"{value} is below {minimum}")
    return value


def _json_hashes(path: Path, line: int, value: Any) -> IntArray:
    if not isinstance(value, list) or any(
        isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in value
    ):
        raise TraceFormatError(path, line, "hash_ids", "must be a list of integers >= 0")
    return np.asarray(value, dtype=np.int64)


def _field_time(path: Path, line: int, text: str) -> float:
    try:
        value = _parse_time(text)
    except ValueError:
        raise TraceFormatError(path, line, COLUMNS[0], f"not a time: {text!r}") from None
    if not math.isfinite(value):
        raise TraceFormatError(path, line, COLUMNS[0], f"not a finite time: {text!r}")
    return value


def _field_int(path: Path, line: int, column: str, text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceFormatError(path, line, column, f"not an integer: {text!r}") from None
    if value < minimum:
        raise TraceFormatError(path, line, column, f"{value} is below {minimum}")
    return value


class Shape(enum.Enum):
    ANY = "any"
    PREFILL_HEAVY = "prefill_heavy"
    DECODE_HEAVY = "decode_heavy"


@dataclass(frozen=True)
class Phase:
    """A share of the trace's duration whose requests take shapes of one kind, scaled."""

    fraction: float
    shape: Shape = Shape.ANY
    prompt_scale: float = 1.0
    output_scale: float = 1.0


def shifting_mix(trace: Trace, phases: Sequence[Phase], seed: int) -> Trace:
    """Real arrival times; per phase, shapes redrawn from the fitting part of the real trace."""
    total = sum(p.fraction for p in phases)
    if not phases or not math.isclose(total, 1.0, rel_tol=1e-6):
        raise InvalidArgument(f"phase fractions must sum to 1, got {total}", field="phases")
    rng = np.random.default_rng(seed)
    ratio = trace.prompt_tokens / trace.output_tokens
    median = float(np.median(ratio))
    pools = {
        Shape.ANY: np.arange(len(trace)),
        Shape.PREFILL_HEAVY: np.flatnonzero(ratio >= median),
        Shape.DECODE_HEAVY: np.flatnonzero(ratio < median),
    }
    prompt = trace.prompt_tokens.copy()
    output = trace.output_tokens.copy()
    start = 0.0
    span = trace.duration_s
    for i, phase in enumerate(phases):
        end = span + 1.0 if i == len(phases) - 1 else start + phase.fraction * span
        sel = np.flatnonzero((trace.arrival_s >= start) & (trace.arrival_s < end))
        draw = rng.choice(pools[phase.shape], size=len(sel), replace=True)
        prompt[sel] = np.maximum(1, np.rint(trace.prompt_tokens[draw] * phase.prompt_scale))
        output[sel] = np.maximum(1, np.rint(trace.output_tokens[draw] * phase.output_scale))
        start = end
    return Trace(trace.arrival_s.copy(), prompt, output)  # shapes redrawn: no hash_ids


def synthetic_trace(
    n: int, rate_per_s: float, prompt_tokens: int, output_tokens: int, seed: int
) -> Trace:
    """Poisson arrivals of identical requests: traffic whose answer can be worked out by hand."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    arrival -= arrival[0]
    return Trace(
        arrival,
        np.full(n, prompt_tokens, dtype=np.int64),
        np.full(n, output_tokens, dtype=np.int64),
    )


def prefix_reuse_tokens(trace: Trace, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> IntArray:
    """Per request, the prompt tokens an unbounded prefix cache could have served.

    A request reuses the longest run of leading ``hash_ids`` that an earlier request's prompt
    began with (a prefix trie of block hashes, in arrival order). The simulator does not model
    a prefix cache; this says how much one could save on a trace that carries the hashes.
    """
    if trace.hash_ids is None:
        raise InvalidArgument("the trace carries no hash_ids", field="hash_ids")
    children: dict[tuple[int, int], int] = {}
    reused = np.zeros(len(trace), dtype=np.int64)
    for i, hashes in enumerate(trace.hash_ids):
        node, matched, extending = 0, 0, True
        for h in hashes.tolist():
            child = children.get((node, h))
            if child is None:
                extending = False
                child = children[(node, h)] = len(children) + 1
            elif extending:
                matched += 1
            node = child
        reused[i] = min(matched * block_tokens, int(trace.prompt_tokens[i]))
    return reused
