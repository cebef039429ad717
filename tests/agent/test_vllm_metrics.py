"""Reading a vLLM server's /metrics into a worker's counters (the text below is the shape vLLM
0.32 serves: counters with _total, per-engine labels, cache_config_info's labels). The vLLM
tier (tests/vllm) checks the same against live servers; this checks the arithmetic."""

from __future__ import annotations

from fleetshift_agent.vllm_worker.metrics import (
    Histogram,
    LatencyWindow,
    parse_metrics,
    wanted_lines,
)

LABELS = 'engine="0",model_name="tiny-vllm"'


def scrape(prompt: int, generated: int, ttft: dict[str, int], running: int = 2) -> str:
    lines = [
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{LABELS}}} {prompt}.0",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{LABELS}}} {generated}.0",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{LABELS}}} {running}.0",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{LABELS}}} 1.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{LABELS}}} 0.25",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="4096"} 1.0',
        "# TYPE vllm:iteration_tokens_total histogram",
        f'vllm:iteration_tokens_total_bucket{{{LABELS},le="+Inf"}} 17.0',
        f"vllm:iteration_tokens_total_count{{{LABELS}}} 17.0",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    lines += [
        f'vllm:time_to_first_token_seconds_bucket{{{LABELS},le="{le}"}} {n}.0'
        for le, n in ttft.items()
    ]
    return "\n".join(lines) + "\n"


def test_counters_come_from_vllms_own_statistics() -> None:
    stats = parse_metrics(scrape(10, 17, {"0.01": 1, "0.1": 3, "+Inf": 4}))
    assert (stats.prompt_tokens, stats.generation_tokens) == (10, 17)
    assert (stats.running, stats.waiting, stats.steps) == (2, 1, 17)
    assert (stats.kv_blocks, stats.block_size) == (4096, 128)
    # 4096 blocks of 128 tokens are 32768 of the daemon's 16-token blocks; a quarter used.
    assert stats.daemon_blocks() == (8192, 32768)


def test_latency_percentiles_are_over_the_recent_window() -> None:
    hist = Histogram(((0.01, 1.0), (0.1, 3.0), (float("inf"), 4.0)))
    # Rank 2 of 4 lies halfway through the (0.01, 0.1] bucket; rank 3.96 in +Inf: its floor.
    assert abs(hist.quantile(0.5) - 0.055) < 1e-9
    assert hist.quantile(0.99) == 0.1
    window = LatencyWindow(window_s=60.0)
    window.add(0.0, parse_metrics(scrape(1, 1, {"0.01": 0, "0.1": 0, "+Inf": 0})))
    old = parse_metrics(scrape(1, 1, {"0.01": 5, "0.1": 5, "+Inf": 5}))
    window.add(30.0, old)
    # 100 s later the early fast requests have left the window: only the slow ones count.
    ttft, _ = window.add(100.0, parse_metrics(scrape(1, 1, {"0.01": 5, "0.1": 9, "+Inf": 9})))
    assert ttft.count == 4 and ttft.quantile(0.5) > 0.01


def test_only_the_families_read_are_parsed_and_each_stays_whole() -> None:
    """vLLM serves ~600 lines; the worker parses the lines of the families it reads. A family
    whose name extends a wanted one (vllm:prompt_tokens_cached) comes whole with it; the rest
    goes, and the statistics are what the whole text gives."""
    other = [
        "# HELP vllm:num_preemptions_total Preemptions.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{LABELS}}} 3.0",
        "# TYPE vllm:prompt_tokens_cached_total counter",
        f"vllm:prompt_tokens_cached_total{{{LABELS}}} 7.0",
    ]
    text = "\n".join(other) + "\n" + scrape(10, 17, {"0.01": 1, "+Inf": 4})
    kept = wanted_lines(text)
    assert "num_preemptions" not in kept
    assert "# TYPE vllm:prompt_tokens_cached_total counter" in kept
    assert f"vllm:prompt_tokens_cached_total{{{LABELS}}} 7.0" in kept
    assert parse_metrics(text) == parse_metrics(scrape(10, 17, {"0.01": 1, "+Inf": 4}))
    assert parse_metrics(text).prompt_tokens == 10  # the cached family is not counted in
