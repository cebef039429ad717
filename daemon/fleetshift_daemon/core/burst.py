"""Burst-aware sizing: how much capacity each phase needs for the arrival process it sees.

A fleet sized for the 300 s mean arrival rate keeps up on average and queues through every
burst: on a service whose 10 s peaks are 3-13x the 5-minute mean, TTFT then grows by the
burst's backlog, not by a request's own work. Sizing therefore looks at the arrivals
themselves, through a fluid queue of one continuous-batching pool:

* work (prompt tokens for prefill, output tokens for decode) arrives per short bucket, so
  both the arrival peaks and the variability of request sizes are in it;
* a pool of service rate ``C`` builds a backlog during a burst and may let it grow to at most
  ``C x delay`` (the time a request may wait: a share of the TTFT SLO for prefill, a share of
  a request's allowed generation time for decode, whose work is spread over its output);
* the smallest such ``C`` is, for every run of buckets, ``work in the run / (run length +
  delay)`` at its maximum (the backlog bound of a fluid queue), never under the mean;
* only bursts shorter than the time to bring capacity back (a start or cold start) need to be
  covered by capacity standing by: a longer one is met by starting workers, which the
  measured-latency loop (``core.slo_monitor``) does at once.

The answer is a *peak factor* per phase: needed capacity over the mean work rate, which the
planner applies to each served request (``ModelDemand.prefill_peak_factor``). Factors are
remembered for ``memory_s`` so that a quiet spell between bursts does not retire what the next
burst of the size already seen will need.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.planner import ModelDemand, SloTarget


@dataclass(frozen=True)
class BurstConfig:
    bucket_s: float = 1.0  # resolution of the arrival process
    prefill_delay_fraction: float = 0.5  # of the TTFT SLO a burst's backlog may add
    decode_delay_fraction: float = 0.5  # of a mean request's output x TBT SLO
    memory_s: float = 1800.0  # a burst's factor stands this long after it was seen
    max_factor: float = 20.0  # a factor is never sized above this (a lone outlier)

    def __post_init__(self) -> None:
        for name in ("bucket_s", "prefill_delay_fraction", "decode_delay_fraction"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{name} must be > 0", field=name)
        if not (math.isfinite(self.memory_s) and self.memory_s >= 0):
            raise InvalidArgument("memory_s must be >= 0", field="memory_s")
        if not (math.isfinite(self.max_factor) and self.max_factor >= 1):
            raise InvalidArgument("max_factor must be >= 1", field="max_factor")


def fluid_capacity(work: np.ndarray, bucket_s: float, delay_s: float, max_run_s: float) -> float:
    """Smallest service rate whose fluid queue over ``work`` (per bucket) never holds more
    than ``delay_s`` of service, for bursts up to ``max_run_s`` long; at least the mean."""
    n = int(work.size)
    if n == 0:
        return 0.0
    mean = float(work.sum()) / (n * bucket_s)
    longest = max(1, min(n, math.ceil(max_run_s / bucket_s)))
    csum = np.concatenate(([0.0], np.cumsum(work, dtype=float)))
    best = mean
    for length in range(1, longest + 1):
        peak = float(np.max(csum[length:] - csum[:-length]))
        best = max(best, peak / (length * bucket_s + delay_s))
    return best


def bucketed(
    times: np.ndarray, values: np.ndarray, start: float, end: float, bucket_s: float
) -> np.ndarray:
    """Sum of ``values`` per bucket of ``[start, end)``."""
    n = max(1, math.ceil((end - start) / bucket_s))
    idx = np.clip(((times - start) / bucket_s).astype(np.int64), 0, n - 1)
    return np.bincount(idx, weights=values, minlength=n)


@dataclass(frozen=True)
class PhaseNeed:
    """Capacity each phase needs standing by, in requests/s of the mix it was measured on.

    Requests, not tokens: a burst is an arrival-rate event, while request sizes follow the
    mix. Remembered in tokens, the prefill load of a prompt-heavy hour would read as a
    standing "burst" for the whole memory after the mix turned decode-heavy."""

    prefill_rps: float = 0.0
    decode_rps: float = 0.0


def phase_need(
    arrivals: tuple[np.ndarray, np.ndarray, np.ndarray],
    span_s: float,
    now: float,
    slo: SloTarget,
    restart_s: float,
    config: BurstConfig,
) -> PhaseNeed:
    """The fluid-queue capacity per phase for the arrivals of the last ``span_s`` seconds."""
    times, prompts, outputs = arrivals
    if times.size < 2 or span_s <= 0:
        return PhaseNeed()
    start, b = now - span_s, config.bucket_s
    delays = (
        slo.ttft_ms / 1e3 * config.prefill_delay_fraction,
        float(outputs.mean()) * slo.tbt_ms / 1e3 * config.decode_delay_fraction,
    )
    needs = [
        fluid_capacity(bucketed(times, values, start, now, b), b, delay, restart_s)
        / max(float(values.mean()), 1.0)
        for values, delay in zip((prompts, outputs), delays, strict=True)
    ]
    return PhaseNeed(needs[0], needs[1])


@dataclass
class _Seen:
    history: deque[tuple[float, PhaseNeed]] = field(default_factory=deque)


class BurstSizer:
    """Peak factors per model, remembered for ``memory_s`` (injected clock)."""

    def __init__(self, clock: Callable[[], float], config: BurstConfig | None = None) -> None:
        self._clock = clock
        self._cfg = config or BurstConfig()
        self._seen: dict[str, _Seen] = {}

    @property
    def config(self) -> BurstConfig:
        return self._cfg

    def size(
        self,
        demand: ModelDemand,
        arrivals: tuple[np.ndarray, np.ndarray, np.ndarray],
        span_s: float,
        slo: SloTarget,
        restart_s: float,
        *,
        record: bool = True,
    ) -> ModelDemand:
        """``demand`` with peak factors: the largest need seen within ``memory_s`` (in
        requests/s, so a burst seen at a higher rate still counts in a quieter window) over
        the window's arrival rate.

        ``record=False`` (an operator's dry run) sizes the same way but leaves the memory
        as it was: a dry run asked during a burst must not raise what later passes size for."""
        cfg, now = self._cfg, self._clock()
        seen = self._seen.setdefault(demand.model, _Seen()) if record else _Seen()
        if not record and demand.model in self._seen:
            seen.history.extend(self._seen[demand.model].history)
        if demand.arrival_rate_per_s > 0:
            seen.history.append((now, phase_need(arrivals, span_s, now, slo, restart_s, cfg)))
        while seen.history and seen.history[0][0] < now - cfg.memory_s:
            seen.history.popleft()
        if not seen.history or demand.arrival_rate_per_s <= 0:
            return demand
        need = PhaseNeed(
            max(n.prefill_rps for _, n in seen.history),
            max(n.decode_rps for _, n in seen.history),
        )
        return with_need(demand, need, cfg.max_factor)


def with_need(demand: ModelDemand, need: PhaseNeed, max_factor: float) -> ModelDemand:
    """``demand`` with the peak factors that make its phases' capacity cover ``need``."""
    rate = demand.arrival_rate_per_s
    return replace(
        demand,
        prefill_peak_factor=_factor(need.prefill_rps, rate, max_factor),
        decode_peak_factor=_factor(need.decode_rps, rate, max_factor),
    )


def _factor(need: float, mean: float, cap: float) -> float:
    if mean <= 0:
        return 1.0
    return min(cap, max(1.0, need / mean))
