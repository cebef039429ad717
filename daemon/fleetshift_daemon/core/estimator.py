"""Estimate a request's output length before it is generated, from recent completions.

Routing and planning need the decode work a request will cause, but most callers do not know
it. Output length barely correlates with prompt length over all traffic, yet it varies a lot
*between* prompt-length ranges (in the Azure conversation trace, 256-511-token prompts average
~95 output tokens while 512-2047-token prompts average ~330), so the estimator learns the mean
output per (model, prompt-length bucket) over a bounded recent history, falling back to the
model's global mean and then to a configured prior while a bucket has too few samples.

It also scores itself: before learning from each completion it records what it would have
predicted, and what the naive global-mean baseline would have, so its error is reported
online next to the baseline's.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from fleetshift_common.bounds import MAX_CONTEXT_TOKENS
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
