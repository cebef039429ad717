"""Estimate a request's output length before it is generated, from recent completions.

Routing and planning need the decode work a request will cause, but most callers do not know
it. Output length barely correlates with prompt length over all traffic, yet it varies a lot
*between* prompt-length ranges (in the Azure conversation trace, 256-511-token prompts average
~95 output tokens while 512-2047-token prompts average ~330), so the estimator learns the mean
output per (model, prompt-length bucket) over a bounded recent history, falling back to the
model's global mean and then to a configured prior while a bucket has too few samples.

It also scores itself: before learning from each completion it records what it would have
predicted, and what the naive global-mean baseline would have, so its error is reported
online next to the baseline's (GetTrafficMix: ``estimator_mae_tokens`` over
``estimator_samples`` completions, and ``estimator_baseline_mae_tokens``; the CLI's
``fleetshift traffic``).

Where completions come from. In the simulator, from its simulated workers. In a real fleet,
from heartbeats: each worker keeps the sessions that finished by their own end (a stop token
or their length; a cancelled session or one moved away says nothing about its output, and a
moved session finishes on its target, counting every token it generated) for 120 s, at most
the last 256, and reports them in ``WorkerInfo.finished_sessions``; its agent relays them in
every heartbeat (``WorkerStatus.finished_sessions``). The same entries therefore arrive in
several heartbeats, and a heartbeat the agent resends after a failure arrives twice, so the
daemon counts each (worker, session id) once (``CompletionLedger``) rather than the agent
dropping only what a daemon acknowledged: that needs no per-agent state, survives an agent or
daemon restart and a lost answer (the daemon applied a heartbeat whose reply never came
back), and each replica of a replicated daemon learns the same completions from the same
heartbeats. The heartbeat handler checks every entry (``validation.check_finished``) before
anything is recorded, so a bad one refuses the heartbeat and teaches the estimator nothing.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fleetshift_common.bounds import MAX_CONTEXT_TOKENS, MAX_FINISHED_SESSIONS
from fleetshift_common.errors import InvalidArgument


@dataclass(frozen=True)
class EstimatorConfig:
    history: int = 2_000  # completions kept per (model, bucket) and per model
    min_samples: int = 20  # a bucket answers only once it has this many
    prior_output_tokens: float = 256.0  # answer for a model never seen
    error_window: int = 5_000  # recent predictions scored
    max_bucket: int = 16  # prompts of 2**16 tokens and longer share a bucket

    def __post_init__(self) -> None:
        for name in ("history", "min_samples", "error_window", "max_bucket"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1", field=name)
        if not self.prior_output_tokens > 0:
            raise InvalidArgument("prior_output_tokens must be > 0", field="prior_output_tokens")


@dataclass(frozen=True)
class EstimatorError:
    n: int
    mae: float  # mean absolute error, tokens
    median_abs_pct: float  # median of |pred - actual| / actual, %
    baseline_mae: float  # same, predicting the model's global mean
    baseline_median_abs_pct: float


class _RunningWindow:
    """Bounded FIFO of values with an O(1) running mean."""

    __slots__ = ("_sum", "_values")

    def __init__(self, maxlen: int) -> None:
        self._values: deque[float] = deque(maxlen=maxlen)
        self._sum = 0.0

    def add(self, v: float) -> None:
        if len(self._values) == self._values.maxlen:
            self._sum -= self._values[0]
        self._values.append(v)
        self._sum += v

    def __len__(self) -> int:
        return len(self._values)

    def mean(self) -> float:
        return self._sum / len(self._values)


def prompt_bucket(prompt_tokens: int, max_bucket: int = 16) -> int:
    """floor(log2(prompt)): buckets double in width, like prompt lengths spread."""
    return min(max(int(prompt_tokens), 1).bit_length() - 1, max_bucket)


class OutputLengthEstimator:
    def __init__(self, config: EstimatorConfig | None = None) -> None:
        self._cfg = config or EstimatorConfig()
        self._buckets: dict[tuple[str, int], _RunningWindow] = {}
        self._global: dict[str, _RunningWindow] = {}
        self._errors: dict[str, deque[tuple[float, float, float]]] = {}
        self._lock = threading.Lock()
        self._context_tokens: dict[str, int] = {}

    def set_context_limits(self, context_tokens: dict[str, int]) -> None:
        """Each model's context length; a model not named is held to MAX_CONTEXT_TOKENS."""
        self._context_tokens = dict(context_tokens)

    def _bounded(self, model: str, prompt_tokens: int, output_tokens: int) -> int | None:
        """A completion that cannot have happened (beyond the model's context) teaches
        nothing; a longer claimed output is clipped to what the context leaves."""
        limit = self._context_tokens.get(model, MAX_CONTEXT_TOKENS)
        if prompt_tokens > limit:
            return None
        return min(output_tokens, limit - prompt_tokens)

    def estimate(self, model: str, prompt_tokens: int) -> float:
        if prompt_tokens <= 0:
            raise InvalidArgument("prompt_tokens must be > 0", field="prompt_tokens")
        cfg = self._cfg
        bucket = self._buckets.get((model, prompt_bucket(prompt_tokens, cfg.max_bucket)))
        if bucket is not None and len(bucket) >= cfg.min_samples:
            return bucket.mean()
        return self._global_mean(model)

    def _global_mean(self, model: str) -> float:
        g = self._global.get(model)
        return g.mean() if g is not None and len(g) > 0 else self._cfg.prior_output_tokens

    def observe_completion(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        if prompt_tokens <= 0:
            raise InvalidArgument("prompt_tokens must be > 0", field="prompt_tokens")
        if output_tokens < 0:
            raise InvalidArgument("output_tokens must be >= 0", field="output_tokens")
        bounded = self._bounded(model, prompt_tokens, output_tokens)
        if bounded is None:
            return
        output_tokens = bounded
        cfg = self._cfg
        with self._lock:
            predicted = self.estimate(model, prompt_tokens)
            baseline = self._global_mean(model)
            errs = self._errors.setdefault(model, deque(maxlen=cfg.error_window))
            errs.append((predicted, baseline, float(output_tokens)))
            key = (model, prompt_bucket(prompt_tokens, cfg.max_bucket))
            self._buckets.setdefault(key, _RunningWindow(cfg.history)).add(output_tokens)
            self._global.setdefault(model, _RunningWindow(cfg.history)).add(output_tokens)

    def error(self, model: str | None = None) -> EstimatorError:
        """Error of the recent predictions of one model, or of all models together."""
        with self._lock:
            rows = [
                r for m, errs in self._errors.items() if model is None or m == model for r in errs
            ]
        if not rows:
            return EstimatorError(0, math.nan, math.nan, math.nan, math.nan)
        a = np.array(rows, dtype=float)
        pred, base, actual = a[:, 0], a[:, 1], a[:, 2]
        denom = np.maximum(actual, 1.0)
        return EstimatorError(
            n=len(rows),
            mae=float(np.abs(pred - actual).mean()),
            median_abs_pct=float(np.median(np.abs(pred - actual) / denom) * 100),
            baseline_mae=float(np.abs(base - actual).mean()),
            baseline_median_abs_pct=float(np.median(np.abs(base - actual) / denom) * 100),
        )


@dataclass(frozen=True)
class Completion:
    """A session that finished on a worker by its own end, as a heartbeat reports it."""

    session_id: str
    prompt_tokens: int
    output_tokens: int


class CompletionLedger:
    """Which reported completions are new: each (worker, session id) is fed to the estimator
    once, however many heartbeats repeat it.

    A worker reports its last MAX_FINISHED_SESSIONS completions, so remembering twice that
    many per worker covers every entry it can still repeat; the least recently heard workers
    are forgotten beyond ``max_workers`` (a stopped worker reports nothing more). A client
    that reuses a session id on the same worker within that window is counted once."""

    def __init__(self, per_worker: int = 2 * MAX_FINISHED_SESSIONS, max_workers: int = 4096):
        self._per_worker = per_worker
        self._max_workers = max_workers
        self._seen: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._lock = threading.Lock()

    def fresh(self, worker_id: str, completions: Iterable[Completion]) -> list[Completion]:
        """The completions not heard before from ``worker_id``, now marked as heard."""
        out: list[Completion] = []
        with self._lock:
            seen = self._seen.get(worker_id)
            if seen is None:
                seen = self._seen[worker_id] = OrderedDict()
                while len(self._seen) > self._max_workers:
                    self._seen.popitem(last=False)
            self._seen.move_to_end(worker_id)
            for c in completions:
                if c.session_id in seen:
                    continue
                seen[c.session_id] = None
                if len(seen) > self._per_worker:
                    seen.popitem(last=False)
                out.append(c)
        return out
