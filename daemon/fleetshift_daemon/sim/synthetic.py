"""Synthetic arrival processes over real request sizes, and service shifts between real traces.

Validation needs traffic the defaults were not chosen on, yet nothing invented about what a
request *is*. So these builders only ever replace *when* requests arrive, or splice two real
services in time; every request's prompt and output length (and Mooncake ``hash_ids``) stay
the trace's own, in the trace's order.

* ``with_arrivals(trace, "poisson")``: a Poisson process at the trace's mean rate (the trace's
  own count of requests over its own duration: a Poisson process conditioned on its count,
  i.e. sorted uniform times).
* ``"on-off"``: bursts whose rate is ``BURST_PEAK`` (10) x the mean rate, ``BURST_S`` (15 s)
  long, one per ``BURST_PERIOD_S`` (300 s) cycle at a seeded random offset; between bursts the
  rate that keeps the same mean (about 0.53x). Same request count and duration.
* ``"ramp"``: the rate rises linearly over the trace, from ``RAMP_FROM`` (0.25x) to
  ``RAMP_TO`` (1.75x) the mean rate (a 7x rise), same mean.
* ``service_shift(first, second)``: the first service's real requests up to the switch
  (default: half of the shorter trace), then the second service's real requests from that
  time on, each at its own real arrival times: one service, then the other.

All of them are deterministic for a given seed.
"""

from __future__ import annotations

import math

import numpy as np

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.sim.trace import FloatArray, Trace

ARRIVAL_PROCESSES = ("poisson", "on-off", "ramp")
BURST_PEAK = 10.0
BURST_S = 15.0
BURST_PERIOD_S = 300.0
RAMP_FROM = 0.25
RAMP_TO = 1.75
_RAMP_STEP_S = 1.0


def arrivals_from_intensity(
    n: int, edges: FloatArray, rates: FloatArray, rng: np.random.Generator
) -> FloatArray:
    """``n`` sorted arrivals of a Poisson process with piecewise-constant intensity.

    ``rates[i]`` holds on ``[edges[i], edges[i+1])``. Conditioned on ``n`` arrivals, an
    inhomogeneous Poisson process is ``n`` sorted uniforms mapped through the inverse of the
    cumulative intensity, so the count (and so the mean rate) is exact.
    """
    if len(edges) != len(rates) + 1 or np.any(np.diff(edges) <= 0) or np.any(rates < 0):
        raise InvalidArgument("intensity needs increasing edges and rates >= 0", field="rates")
    cumulative = np.concatenate(([0.0], np.cumsum(rates * np.diff(edges))))
    if cumulative[-1] <= 0:
        raise InvalidArgument("intensity is zero everywhere", field="rates")
    u = np.sort(rng.uniform(0.0, cumulative[-1], n))
    return np.asarray(np.interp(u, cumulative, edges), dtype=np.float64)


def poisson_arrivals(n: int, duration_s: float, rng: np.random.Generator) -> FloatArray:
    return arrivals_from_intensity(n, np.array([0.0, duration_s]), np.array([1.0]), rng)


def on_off_intensity(
    duration_s: float,
    rng: np.random.Generator,
    peak: float = BURST_PEAK,
    burst_s: float = BURST_S,
    period_s: float = BURST_PERIOD_S,
) -> tuple[FloatArray, FloatArray]:
    """Edges and rates (relative to the mean, which they keep at 1) of the on-off process."""
    share = burst_s / period_s
    if not (peak > 1 and share > 0 and peak * share < 1):
        raise InvalidArgument(
            f"on-off needs peak > 1 and peak x burst/period < 1, got {peak} x {share:.3f}",
            field="peak",
        )
    off = (1.0 - peak * share) / (1.0 - share)
    edges = [0.0]
    rates = []
    for start in np.arange(0.0, duration_s, period_s):
        end = min(start + period_s, duration_s)
        on = start + rng.uniform(0.0, max(end - start - burst_s, 0.0))
        for a, b, r in (
            (start, on, off),
            (on, min(on + burst_s, end), peak),
            (on + burst_s, end, off),
        ):
            if b > a:
                edges.append(b)
                rates.append(r)
    return np.asarray(edges, dtype=np.float64), np.asarray(rates, dtype=np.float64)


def on_off_arrivals(n: int, duration_s: float, rng: np.random.Generator) -> FloatArray:
    edges, rates = on_off_intensity(duration_s, rng)
    return arrivals_from_intensity(n, edges, rates, rng)


def ramp_arrivals(n: int, duration_s: float, rng: np.random.Generator) -> FloatArray:
    steps = max(1, math.ceil(duration_s / _RAMP_STEP_S))
    edges = np.linspace(0.0, duration_s, steps + 1)
    mid = (edges[:-1] + edges[1:]) / 2 / duration_s
    return arrivals_from_intensity(n, edges, RAMP_FROM + (RAMP_TO - RAMP_FROM) * mid, rng)


def with_arrivals(trace: Trace, process: str, seed: int) -> Trace:
    """The trace's requests, in order, at arrival times drawn from ``process``."""
    makers = {"poisson": poisson_arrivals, "on-off": on_off_arrivals, "ramp": ramp_arrivals}
    if process not in makers:
        raise InvalidArgument(
            f"unknown arrival process {process!r} (known: {ARRIVAL_PROCESSES})", field="arrivals"
        )
    if len(trace) < 2 or trace.duration_s <= 0:
        raise InvalidArgument("a synthetic process needs a trace of some duration", field="trace")
    arrival = makers[process](len(trace), trace.duration_s, np.random.default_rng(seed))
    arrival -= arrival[0]
    return trace.take(np.arange(len(trace)), arrival)


def service_shift(first: Trace, second: Trace, switch_s: float | None = None) -> Trace:
    """``first``'s requests before ``switch_s``, then ``second``'s from ``switch_s`` on."""
    if switch_s is None:
        switch_s = min(first.duration_s, second.duration_s) / 2
    if not 0 < switch_s < second.duration_s:
        raise InvalidArgument(
            f"switch time must lie inside the second trace (0, {second.duration_s:.0f}) s, "
            f"got {switch_s}",
            field="switch_s",
        )
    head = first.window(0.0, switch_s)
    tail = second.window(switch_s, math.inf)
    hashes = None
    if head.hash_ids is not None and tail.hash_ids is not None:
        hashes = np.concatenate((head.hash_ids, tail.hash_ids))
    return Trace(
        np.concatenate((head.arrival_s, tail.arrival_s)),
        np.concatenate((head.prompt_tokens, tail.prompt_tokens)),
        np.concatenate((head.output_tokens, tail.output_tokens)),
        hashes,
    )
