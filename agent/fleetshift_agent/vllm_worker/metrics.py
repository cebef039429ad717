"""vLLM's own statistics, read from its Prometheus ``/metrics``, as a worker's counters.

The daemon's traffic monitor, router and online calibration read a worker's counters from
every heartbeat (``WorkerCounters``); a vLLM worker fills them from what vLLM itself counts,
not from a second count kept by the shim: prompt and generation tokens, running and waiting
requests, KV usage, and TTFT / inter-token latency from vLLM's histograms. The histograms are
cumulative since vLLM started, so the percentiles here come from the difference between the
newest scrape and one about a window earlier, as the reference engine's come from its recent
samples. Pure: no HTTP, no clock of its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# The reference engine's KV block (the daemon's unit for kv_blocks_*): vLLM's own blocks (128
# tokens on a CPU) are reported in these units so that a block means the same to the daemon.
DAEMON_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: (upper bound, count <= bound), +Inf last."""

    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since ``earlier`` (a scrape of the same histogram)."""
        before = dict(earlier.buckets)
        return Histogram(tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets))

    def quantile(self, q: float) -> float:
        """As PromQL's histogram_quantile: linear within the bucket that holds the rank;
        0 when empty; the largest finite bound when the rank falls in +Inf."""
        total = self.count
        if total <= 0:
            return 0.0
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return lower_bound
                span = n - lower_count
                frac = (rank - lower_count) / span if span > 0 else 1.0
                return lower_bound + (le - lower_bound) * frac
            lower_bound, lower_count = le, n
        return lower_bound


@dataclass(frozen=True)
class VllmStats:
    """One scrape of a vLLM server's metrics (summed over label sets: one model per server)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    kv_blocks: int = 0  # vLLM's own blocks of its KV cache
    block_size: int = 0  # tokens per vLLM block
    steps: int = 0  # engine iterations (vllm:iteration_tokens_total's count)
    prefix_cache_hits: int = 0  # tokens served from the local prefix cache
    external_prefix_cache_hits: int = 0  # tokens whose KV a KV connector brought in
    ttft: Histogram = field(default_factory=Histogram)
    tbt: Histogram = field(default_factory=Histogram)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def daemon_blocks(self) -> tuple[int, int]:
        """(used, total) KV blocks in the daemon's 16-token unit."""
        total = self.kv_tokens // DAEMON_BLOCK_TOKENS
        return min(total, round(self.kv_usage * total)), total


_COUNTERS = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:external_prefix_cache_hits": "external_prefix_cache_hits",
}
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "tbt",
}


_STEPS = "vllm:iteration_tokens_total"
_CONFIG = "vllm:cache_config_info"
_WANTED = (*_COUNTERS, *_GAUGES, *_HISTOGRAMS, _STEPS, _CONFIG)
_COMMENTS = ("# HELP ", "# TYPE ")


def wanted_lines(text: str) -> str:
    """The lines of the families ``parse_metrics`` reads, and their HELP and TYPE lines.

    vLLM serves some 600 lines; prometheus_client's parser took 8 ms over all of them here
    (bench/vllm_metrics_parse.py), inside every move's import that counts the KV's arrival.
    A family's samples and comments all begin with its name, so keeping every line whose
    name begins with a wanted one keeps each such family whole (and any other family whose
    name extends one, which the parse then ignores)."""
    kept = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(_COMMENTS) else line
        if name.startswith(_WANTED):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_metrics(text: str) -> VllmStats:
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    steps = 0.0
    kv_blocks = block_size = 0
    for family in text_string_to_metric_families(wanted_lines(text)):
        name = family.name
        for sample in family.samples:
            if name in _COUNTERS and sample.name.endswith("_total"):
                key = _COUNTERS[name]
                values[key] = values.get(key, 0.0) + sample.value
            elif name in _GAUGES:
                key = _GAUGES[name]
                values[key] = values.get(key, 0.0) + sample.value
            elif name in _HISTOGRAMS and sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                per = buckets.setdefault(_HISTOGRAMS[name], {})
                per[le] = per.get(le, 0.0) + sample.value
            elif name == _STEPS and sample.name.endswith("_count"):
                steps += sample.value
            elif name == _CONFIG:
                kv_blocks = int(_number(sample.labels.get("num_gpu_blocks")))
                block_size = int(_number(sample.labels.get("block_size")))
    return VllmStats(
        prompt_tokens=int(values.get("prompt_tokens", 0)),
        generation_tokens=int(values.get("generation_tokens", 0)),
        running=int(values.get("running", 0)),
        waiting=int(values.get("waiting", 0)),
        kv_usage=values.get("kv_usage", 0.0),
        kv_blocks=kv_blocks,
        block_size=block_size,
        steps=int(steps),
        prefix_cache_hits=int(values.get("prefix_cache_hits", 0)),
        external_prefix_cache_hits=int(values.get("external_prefix_cache_hits", 0)),
        ttft=_histogram(buckets.get("ttft", {})),
        tbt=_histogram(buckets.get("tbt", {})),
    )


def _number(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def _histogram(per_bound: dict[float, float]) -> Histogram:
    return Histogram(tuple(sorted(per_bound.items())))


@dataclass
class LatencyWindow:
    """Percentiles over roughly the last ``window_s`` of a server's life, from scrapes."""

    window_s: float = 60.0
    _scrapes: deque[tuple[float, VllmStats]] = field(default_factory=deque)

    def add(self, now: float, stats: VllmStats) -> tuple[Histogram, Histogram]:
        """Record a scrape; the (TTFT, TBT) observations since the oldest one kept."""
        self._scrapes.append((now, stats))
        while len(self._scrapes) > 2 and now - self._scrapes[1][0] >= self.window_s:
            self._scrapes.popleft()
        base = self._scrapes[0][1] if len(self._scrapes) > 1 else VllmStats()
        return stats.ttft.minus(base.ttft), stats.tbt.minus(base.tbt)


def p50_p99_ms(hist: Histogram) -> tuple[float, float]:
    return hist.quantile(0.5) * 1000.0, hist.quantile(0.99) * 1000.0
