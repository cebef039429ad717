"""What reading a vLLM server's /metrics costs the worker, and what parsing only the wanted
families saves, beside parsing all of them (the code before) in the same run.

A vLLM worker reads vLLM's Prometheus text for every heartbeat's counters and around every
import whose KV arrival it counts (docs/vllm.md); the import's reads sit inside the moved
session's pause. One vLLM worker (as the agent starts it, vLLM's CPU build, the tiny
tests/vllm model); a few requests so that the histograms hold observations; then
``--scrapes`` GETs of /metrics, each timed, and each text parsed both ways, alternately:
``parse_metrics`` (the wanted families' lines only) and the same with every line kept (the
baseline). Checks that both give the same statistics, and prints the medians.

    .venv/bin/python bench/vllm_metrics_parse.py [--scrapes 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_fleet import deadline, machine_load, make_vllm_model, serving_worker
from fleetshift_agent.vllm_worker import metrics


def parse_all(text: str) -> metrics.VllmStats:
    """``parse_metrics`` with every line kept: what the worker did before the filter."""
    keep = metrics.wanted_lines
    metrics.wanted_lines = lambda whole: whole  # type: ignore[assignment]
    try:
        return metrics.parse_metrics(text)
    finally:
        metrics.wanted_lines = keep  # type: ignore[assignment]


def timed(fn: object, text: str) -> tuple[float, metrics.VllmStats]:
    started = time.perf_counter()
    stats = fn(text)  # type: ignore[operator]
    return time.perf_counter() - started, stats


def measure(port: int, scrapes: int) -> None:
    base = f"http://127.0.0.1:{port}"
    fetch, filtered, whole = [], [], []
    with httpx.Client(timeout=60) as client:
        for n in range(8):  # observations in every histogram
            body = {"model": "vllm-bench", "prompt": list(range(3, 40 + n)), "max_tokens": 16}
            client.post(f"{base}/v1/completions", json=body).raise_for_status()
        text = ""
        for i in range(scrapes):
            started = time.perf_counter()
            text = client.get(f"{base}/metrics").text
            fetch.append(time.perf_counter() - started)
            order = (
                (parse_all, metrics.parse_metrics) if i % 2 else (metrics.parse_metrics, parse_all)
            )
            results = {fn: timed(fn, text) for fn in order}
            filtered.append(results[metrics.parse_metrics][0])
            whole.append(results[parse_all][0])
            if results[metrics.parse_metrics][1] != results[parse_all][1]:
                sys.exit("the filtered parse differs from the whole one on this text")
    lines, kept = text.count("\n"), metrics.wanted_lines(text).count("\n")
    print(f"/metrics: {len(text):,} bytes, {lines} lines, {kept} kept by the filter")
    print("| step | median (ms) | p90 (ms) |\n|---|---|---|")
    for label, xs in (
        ("GET /metrics (vLLM renders it)", fetch),
        ("parse, every line (baseline: the code before)", whole),
        ("parse, the wanted families' lines (parse_metrics)", filtered),
    ):
        p90 = statistics.quantiles(xs, n=10)[-1]
        print(f"| {label} | {statistics.median(xs) * 1e3:.2f} | {p90 * 1e3:.2f} |")
    print("both parses gave the same statistics on every scrape")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scrapes", type=int, default=30)
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args()
    deadline(args.timeout_s)
    print(f"load before: {machine_load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_vllm_model(root / "model", 2048)
        engine = {
            "dtype": "float32",
            "max_model_len": 2048,
            "kv_cache_gib": 1.0,
            "enforce_eager": True,
        }
        with serving_worker(model, root, "worker", engine) as worker:
            measure(worker.vllm_port, args.scrapes)
    print(f"load after:  {machine_load()}")


if __name__ == "__main__":
    main()
