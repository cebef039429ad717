"""Request traces in the Azure LLM inference format, and the ways the simulator reshapes them.

A placement decision only needs the shape of each request (when, how long a prompt, how many
tokens out), so a trace is three numpy columns. The loader takes any CSV with the three Azure
columns so that an operator can replay their own traffic; a malformed file is refused with the
line and column at fault, never half-loaded.

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
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fleetshift_common.errors import InvalidArgument

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_REPLICA_JITTER_S = 0.5

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class TraceFormatError(InvalidArgument):
    """A trace file that is not a CSV of the three Azure columns; names the line and column."""

    def __init__(self, path: Path, line: int, column: str, why: str) -> None:
        super().__init__(f"{path}: line {line}, column {column}: {why}", field=column)
        self.line = line
        self.column = column


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests sorted by arrival; arrival times in seconds from the first request."""

    arrival_s: FloatArray
    prompt_tokens: IntArray
    output_tokens: IntArray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise InvalidArgument("trace columns differ in length", field="trace")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def window(self, start_s: float, end_s: float) -> Trace:
        """The requests arriving in ``[start_s, end_s)``, times kept."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        return Trace(self.arrival_s[lo:hi], self.prompt_tokens[lo:hi], self.output_tokens[lo:hi])

    def head(self, n: int) -> Trace:
        return Trace(self.arrival_s[:n], self.prompt_tokens[:n], self.output_tokens[:n])

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
        return _sorted(arrival, self.prompt_tokens[idx], self.output_tokens[idx])

    def time_compressed(self, factor: float) -> Trace:
        if not factor > 0 or not math.isfinite(factor):
            raise InvalidArgument(f"time compression must be > 0, got {factor}", field="time")
        return Trace(self.arrival_s / factor, self.prompt_tokens, self.output_tokens)


def _sorted(arrival: FloatArray, prompt: IntArray, output: IntArray) -> Trace:
    order = np.argsort(arrival, kind="stable")
    return Trace(arrival[order], prompt[order], output[order])


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


def load_trace(path: str | Path) -> Trace:
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
    arrival = np.asarray(times, dtype=np.float64)
    arrival -= arrival.min()
    return _sorted(
        arrival, np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64)
    )


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
    return Trace(trace.arrival_s.copy(), prompt, output)


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
