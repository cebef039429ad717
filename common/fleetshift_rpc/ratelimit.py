"""Token buckets per caller, in a table that cannot grow without bound.

One misbehaving agent or script must not starve the heartbeats of a thousand healthy nodes, so
each caller (its principal, or its address when anonymous) gets its own bucket. The table is an
LRU of bounded size: a flood of distinct clients evicts the least recently seen buckets instead
of growing memory; an evicted caller simply starts again with a full bucket, which errs towards
serving, never towards refusing a legitimate caller.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fleetshift_common.config import ConfigError


@dataclass(frozen=True)
class RateLimit:
    rate_per_s: float = 50.0  # sustained calls per second per caller
    burst: int = 100  # calls a caller may make at once after being idle
    max_clients: int = 10_000  # buckets kept; least recently seen evicted beyond this

    def __post_init__(self) -> None:
        keys = {
            "rate_per_s": "rate_limit_per_s",
            "burst": "rate_limit_burst",
            "max_clients": "rate_limit_max_clients",
        }
        for name, key in keys.items():
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"config key '{key}' must be > 0, got {getattr(self, name)}", field=key
                )


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float = 0.0  # when refused: wait this long for one token

    @property
    def retry_after_ms(self) -> int:
        return max(1, math.ceil(self.retry_after_s * 1000))


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, updated: float) -> None:
        self.tokens = tokens
        self.updated = updated


class RateLimiter:
    """Thread-safe: servicers may run in worker threads, the interceptor on the event loop."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, key: str, cost: float = 1.0) -> Decision:
        limit = self._limit
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = _Bucket(float(limit.burst), now)
                self._buckets[key] = bucket
                if len(self._buckets) > limit.max_clients:
                    self._buckets.popitem(last=False)
                    self.evictions += 1
            else:
                self._buckets.move_to_end(key)
                elapsed = max(0.0, now - bucket.updated)
                bucket.tokens = min(float(limit.burst), bucket.tokens + elapsed * limit.rate_per_s)
                bucket.updated = now
            if bucket.tokens >= cost:
                bucket.tokens -= cost
                return Decision(True)
            return Decision(False, (cost - bucket.tokens) / limit.rate_per_s)
