"""A sliding-window view of each model's traffic mix, for the planner and the router.

A placement goes wrong because the mix moves (long prompts in the morning, chatty decode in
the evening) while every worker stays healthy. The planner therefore needs the *recent* shape
of the traffic per model: arrival rate, prompt and output length distributions, and how the
work splits between prefill and decode. Route calls feed what requests ask for; worker
counters feed what the fleet actually processed (they include requests routed elsewhere and
real output lengths), and the counter figures win when both exist.

Memory is bounded: each model keeps at most ``max_requests`` recent requests and
``max_counter_samples`` counter deltas; under heavier load the window effectively shortens to
the span those samples cover, and rates are computed over that span.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from fleetshift_common.bounds import MAX_CONTEXT_TOKENS
from fleetshift_common.errors import InvalidArgument, NotFound


@dataclass(frozen=True)
class TrafficConfig:
    window_s: float = 300.0
    max_requests: int = 50_000
    max_counter_samples: int = 10_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise InvalidArgument("window_s must be > 0", field="window_s")
        if self.max_requests < 1:
            raise InvalidArgument("max_requests must be >= 1", field="max_requests")
        if self.max_counter_samples < 1:
            raise InvalidArgument("max_counter_samples must be >= 1", field="max_counter_samples")


@dataclass(frozen=True)
class LengthStats:
    mean: float
    p50: float
    p90: float

    @staticmethod
    def of(values: np.ndarray) -> LengthStats:
        if values.size == 0:
            return LengthStats(0.0, 0.0, 0.0)
        p50, p90 = np.percentile(values, [50, 90])
        return LengthStats(float(values.mean()), float(p50), float(p90))


@dataclass(frozen=True)
class TrafficStats:
    model: str
    window_s: float  # span actually covered (<= configured window)
    requests: int
    arrival_rate_per_s: float
    prompt: LengthStats
    output: LengthStats
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    source: str  # "counters" when worker counters gave the token rates, else "requests"

    @property
    def prefill_decode_ratio(self) -> float:
        """Prefill tokens per decode token: > 1 is prompt-heavy, < 1 decode-heavy."""
        if self.decode_tokens_per_s <= 0:
            return math.inf if self.prefill_tokens_per_s > 0 else 0.0
        return self.prefill_tokens_per_s / self.decode_tokens_per_s


@dataclass
class _ModelWindow:
    requests: deque[tuple[float, int, float]]
    counters: deque[tuple[float, int, int]]
    created: float
    last_totals: dict[str, tuple[int, int]] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # when each worker's totals came


# No worker processes more tokens than this per second (an 8-GPU H200 node prefills well under
# a million): a larger jump between two heartbeats (a buggy or hostile agent, a counter that
# wrapped) is ignored rather than read as demand.
MAX_TOKENS_PER_S_PER_WORKER = 10_000_000.0


def plausible_counter_delta(prefill_tokens: int, decode_tokens: int, elapsed_s: float) -> bool:
    """Whether one worker could have processed this many tokens in ``elapsed_s`` (at least a
    second's worth is allowed, so back-to-back heartbeats are never refused)."""
    cap = MAX_TOKENS_PER_S_PER_WORKER * max(elapsed_s, 1.0)
    return prefill_tokens <= cap and decode_tokens <= cap


def bounded_observation(
    prompt_tokens: int, output_tokens: float, context_tokens: int = MAX_CONTEXT_TOKENS
) -> tuple[int, float] | None:
    """What one request may contribute to a model's mix: nothing when its prompt alone does
    not fit the model's context (no such request can run), else its output clipped to the
    rest of the context. So one call moves a window's mean length by at most
    ``context_tokens / requests in the window``, whatever the caller claims."""
    if prompt_tokens > context_tokens:
        return None
    return prompt_tokens, min(float(output_tokens), float(context_tokens - prompt_tokens))


class TrafficMonitor:
    """Thread-safe; ``observe_*`` are O(1) amortised, ``stats`` is O(window samples)."""

    def __init__(self, clock: Callable[[], float], config: TrafficConfig | None = None) -> None:
        self._clock = clock
        self._config = config or TrafficConfig()
        self._started = clock()  # workers born after this were counted from their first token
        self._models: dict[str, _ModelWindow] = {}
        self._lock = threading.Lock()
        self._context_tokens: dict[str, int] = {}
        # What observe_request took in since the last take_own_arrivals, in order, each
        # (model, time, prompt, output); None until keep_own_arrivals (a sole daemon).
        self._own: deque[tuple[str, float, int, float]] | None = None

    def set_context_limits(self, context_tokens: dict[str, int]) -> None:
        """Each model's context length; a model not named is held to MAX_CONTEXT_TOKENS."""
        self._context_tokens = dict(context_tokens)

    @property
    def config(self) -> TrafficConfig:
        return self._config

    def _window(self, model: str) -> _ModelWindow:
        w = self._models.get(model)
        if w is None:
            cfg = self._config
            w = _ModelWindow(
                requests=deque(maxlen=cfg.max_requests),
                counters=deque(maxlen=cfg.max_counter_samples),
                created=self._clock(),
            )
            self._models[model] = w
        return w

    def observe_request(self, model: str, prompt_tokens: int, output_tokens: float) -> None:
        """One routed request; ``output_tokens`` may be an estimate."""
        if prompt_tokens <= 0:
            raise InvalidArgument("prompt_tokens must be > 0", field="prompt_tokens")
        if not (math.isfinite(output_tokens) and output_tokens >= 0):
            raise InvalidArgument("output_tokens must be >= 0", field="output_tokens")
        limit = self._context_tokens.get(model, MAX_CONTEXT_TOKENS)
        bounded = bounded_observation(prompt_tokens, output_tokens, limit)
        if bounded is None:
            return
        now = self._clock()
        with self._lock:
            w = self._window(model)
            w.requests.append((now, *bounded))
            self._evict(w, now)
            if self._own is not None:
                self._own.append((model, now, *bounded))

    def keep_own_arrivals(self) -> None:
        """From now on keep every request ``observe_request`` takes in (what this process
        answered itself, not what ``observe_requests_at`` merged) for ``take_own_arrivals``.
        A daemon replica publishes them, so every other replica counts each exactly once
        (docs/replicas.md). Bounded like a window: when nobody takes them for longer than
        ``max_requests`` requests, the oldest are dropped."""
        with self._lock:
            if self._own is None:
                self._own = deque(maxlen=self._config.max_requests)

    def take_own_arrivals(self) -> list[tuple[str, float, int, float]]:
        """The requests observed here since the last call, oldest first, each ``(model,
        time, prompt, output)`` after the window's bounds; each is handed out once."""
        with self._lock:
            if not self._own:
                return []
            own = list(self._own)
            self._own.clear()
        return own

    def observe_requests_at(self, model: str, arrivals: Iterable[tuple[float, int, float]]) -> int:
        """Requests another daemon replica routed, each ``(time on this clock, prompt,
        output)``: the leader plans on the whole fleet's arrivals, not only on the share it
        answered itself (issue 17). Held to the same bounds as ``observe_request``, and merged
        in time order (burst sizing reads the arrival process). Returns how many were kept."""
        limit = self._context_tokens.get(model, MAX_CONTEXT_TOKENS)
        rows: list[tuple[float, int, float]] = []
        for at, prompt, out in arrivals:
            if prompt <= 0 or not (math.isfinite(at) and math.isfinite(out) and out >= 0):
                continue
            bounded = bounded_observation(prompt, out, limit)
            if bounded is not None:
                rows.append((at, *bounded))
        if not rows:
            return 0
        rows.sort()
        now = self._clock()
        with self._lock:
            w = self._window(model)
            later: list[tuple[float, int, float]] = []
            while w.requests and w.requests[-1][0] > rows[0][0]:
                later.append(w.requests.pop())
            w.requests.extend(heapq.merge(rows, reversed(later)))
            self._evict(w, now)
        return len(rows)

    def observe_counters(
        self,
        worker_id: str,
        model: str,
        prefill_tokens_total: int,
        decode_tokens_total: int,
        born_at: float | None = None,
    ) -> None:
        """Cumulative token counters of one worker; a counter that went back means a restart.

        The first sight of a worker is only a baseline, since its counts may predate this
        monitor, unless ``born_at`` (when the daemon created the worker, on this clock) says
        the worker started while this monitor watched: then every count is new and is taken
        from zero. Without it a fresh worker's first heartbeat interval of tokens, often its
        first burst, was missing from the mix."""
        if prefill_tokens_total < 0 or decode_tokens_total < 0:
            raise InvalidArgument("token counters must be >= 0", field="prefill_tokens_total")
        now = self._clock()
        with self._lock:
            w = self._window(model)
            prev = w.last_totals.get(worker_id)
            w.last_totals[worker_id] = (prefill_tokens_total, decode_tokens_total)
            seen, w.last_seen[worker_id] = w.last_seen.get(worker_id, now), now
            if prev is None and born_at is not None and self._started <= born_at <= now:
                prev, seen = (0, 0), born_at
            if prev is None:
                return
            dp = prefill_tokens_total - prev[0]
            dd = decode_tokens_total - prev[1]
            if dp < 0 or dd < 0:  # restarted worker: counts since restart are the delta
                dp, dd = prefill_tokens_total, decode_tokens_total
            if not plausible_counter_delta(dp, dd, now - seen):
                return
            w.counters.append((now, dp, dd))
            self._evict(w, now)

    def forget_worker(self, worker_id: str) -> None:
        with self._lock:
            for w in self._models.values():
                w.last_totals.pop(worker_id, None)
                w.last_seen.pop(worker_id, None)

    def _evict(self, w: _ModelWindow, now: float) -> None:
        horizon = now - self._config.window_s
        while w.requests and w.requests[0][0] < horizon:
            w.requests.popleft()
        while w.counters and w.counters[0][0] < horizon:
            w.counters.popleft()

    def arrivals(self, model: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The window's requests of ``model`` as (arrival times, prompt, output) columns.

        Burst-aware sizing (``core.burst``) needs the arrival process, not its mean; an
        unknown model has no arrivals."""
        now = self._clock()
        with self._lock:
            w = self._models.get(model)
            if w is None:
                empty = np.empty(0)
                return empty, empty, empty
            self._evict(w, now)
            reqs = np.array(w.requests, dtype=float).reshape(-1, 3)
        return reqs[:, 0], reqs[:, 1], reqs[:, 2]

    def models(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._models))

    def all_stats(self) -> dict[str, TrafficStats]:
        return {m: self.stats(m) for m in self.models()}

    def stats(self, model: str) -> TrafficStats:
        now = self._clock()
        with self._lock:
            w = self._models.get(model)
            if w is None:
                raise NotFound(f"model {model!r} has no traffic", field="model")
            self._evict(w, now)
            reqs = np.array(w.requests, dtype=float).reshape(-1, 3)
            ctrs = np.array(w.counters, dtype=float).reshape(-1, 3)
            created = w.created
        cfg = self._config
        span = _span(reqs[:, 0], now, created, cfg.window_s, cfg.max_requests)
        n = reqs.shape[0]
        prompts, outputs = reqs[:, 1], reqs[:, 2]
        source = "requests"
        prefill_rate = float(prompts.sum()) / span
        decode_rate = float(outputs.sum()) / span
        if ctrs.shape[0] > 0:
            cspan = _span(ctrs[:, 0], now, created, cfg.window_s, cfg.max_counter_samples)
            prefill_rate = float(ctrs[:, 1].sum()) / cspan
            decode_rate = float(ctrs[:, 2].sum()) / cspan
            source = "counters"
        return TrafficStats(
            model=model,
            window_s=span,
            requests=n,
            arrival_rate_per_s=n / span,
            prompt=LengthStats.of(prompts),
            output=LengthStats.of(outputs),
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            source=source,
        )


def _span(times: np.ndarray, now: float, created: float, window: float, maxlen: int) -> float:
    """Seconds the samples stand for: the window, or less when the model is new or the
    buffer filled up and dropped older samples."""
    span = min(window, max(now - created, 1e-3))
    if times.size >= maxlen:
        span = min(span, max(now - float(times.min()), 1e-3))
    return span
