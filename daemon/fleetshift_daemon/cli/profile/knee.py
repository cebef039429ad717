"""The knee of a throughput/latency curve: where more concurrency stops paying.

Below the knee, doubling the sessions doubles throughput at the same latency; past it,
throughput flattens and latency climbs. The knee is taken as the concurrency that maximises
*power* = throughput / latency (Kleinrock's optimal operating point): it needs no threshold,
so nothing here is tuned on the curves it is then reported on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CurvePoint:
    concurrency: int
    throughput: float  # tokens/s
    latency: float  # s (a decode step, or a request end to end)


@dataclass(frozen=True)
class Knee:
    concurrency: int
    throughput: float
    latency: float
    saturated: bool  # False: power still rose at the largest concurrency measured


def find_knee(curve: Sequence[CurvePoint]) -> Knee:
    if not curve:
        raise ValueError("no points to find a knee in")
    for p in curve:
        if p.throughput <= 0 or p.latency <= 0:
            raise ValueError(f"concurrency {p.concurrency}: throughput and latency must be > 0")
    ordered = sorted(curve, key=lambda p: p.concurrency)
    best = max(ordered, key=lambda p: p.throughput / p.latency)
    return Knee(
        best.concurrency,
        best.throughput,
        best.latency,
        saturated=best is not ordered[-1],
    )
