from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetshift_common.errors import InvalidArgument, NotFound
from fleetshift_daemon.core.traffic import TrafficConfig, TrafficMonitor

from ..clock import ManualClock
from .trace import load_trace


def test_window_stats_on_the_azure_trace(azure_trace: Path) -> None:
    times, prompts, outputs = load_trace(azure_trace)
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock, TrafficConfig(window_s=300))
    for t, p, o in zip(times.tolist(), prompts.tolist(), outputs.tolist(), strict=True):
        clock.t = 1000.0 + t
        mon.observe_request("llama2-70b", p, o)
    s = mon.stats("llama2-70b")
    last = (times >= times[-1] - 300) & (times >= 0)
    assert s.requests == int(last.sum())
    assert s.arrival_rate_per_s == pytest.approx(last.sum() / 300)
    assert s.prompt.mean == pytest.approx(prompts[last].mean())
    assert s.prompt.p50 == pytest.approx(np.percentile(prompts[last], 50))
    assert s.output.p90 == pytest.approx(np.percentile(outputs[last], 90))
    # conversation traffic is prompt-heavy: several prompt tokens per output token
    assert s.prefill_decode_ratio == pytest.approx(prompts[last].sum() / outputs[last].sum())
    assert s.prefill_decode_ratio > 3
    assert s.source == "requests"


def test_old_requests_leave_the_window() -> None:
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock, TrafficConfig(window_s=60))
    for _ in range(60):
        mon.observe_request("m", 4000, 10)  # prompt-heavy burst
        clock.t += 1
    clock.t += 30
    for _ in range(30):
        mon.observe_request("m", 100, 900)  # decode-heavy now
        clock.t += 1
    s = mon.stats("m")
    assert s.requests == 30
    assert s.prefill_decode_ratio < 0.2


def test_memory_is_bounded_and_rates_use_the_span_kept() -> None:
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock, TrafficConfig(window_s=300, max_requests=100))
    for _ in range(1000):
        mon.observe_request("m", 10, 10)
        clock.t += 0.01  # 100 requests/s
    s = mon.stats("m")
    assert s.requests == 100
    assert s.arrival_rate_per_s == pytest.approx(100, rel=0.05)


def test_worker_counters_win_over_route_estimates() -> None:
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock, TrafficConfig(window_s=100))
    mon.observe_request("m", 1000, 100)
    mon.observe_counters("w1", "m", 0, 0)
    mon.observe_counters("w2", "m", 50, 50)
    clock.t += 10
    mon.observe_counters("w1", "m", 2000, 8000)
    mon.observe_counters("w2", "m", 10, 20)  # restarted: counts since restart
    s = mon.stats("m")
    assert s.source == "counters"
    assert s.prefill_tokens_per_s == pytest.approx(2010 / 10)
    assert s.decode_tokens_per_s == pytest.approx(8020 / 10)


def test_a_worker_born_while_watched_counts_from_its_first_token() -> None:
    """A worker the daemon started after the monitor did has no history before it: its first
    report's tokens are traffic (they were lost as a baseline). One adopted from before the
    monitor started is only a baseline, since its counts may be hours old."""
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock, TrafficConfig(window_s=100))
    clock.t += 5
    mon.observe_counters("old", "m", 9_000, 9_000, born_at=900.0)  # before the monitor
    mon.observe_counters("new", "m", 0, 0)  # a first report with nothing yet: no change
    mon.observe_counters("born", "m", 300, 600, born_at=1002.0)  # 3 s of life, all new
    clock.t += 10
    mon.observe_counters("old", "m", 9_100, 9_200, born_at=900.0)
    s = mon.stats("m")
    assert s.source == "counters"
    assert s.prefill_tokens_per_s * s.window_s == pytest.approx(300 + 100)
    assert s.decode_tokens_per_s * s.window_s == pytest.approx(600 + 200)


def test_unknown_model_and_bad_input() -> None:
    mon = TrafficMonitor(ManualClock(1000.0))
    with pytest.raises(NotFound) as exc:
        mon.stats("nope")
    assert exc.value.field == "model"
    with pytest.raises(InvalidArgument) as exc2:
        mon.observe_request("m", 0, 1)
    assert exc2.value.field == "prompt_tokens"


def test_all_stats_covers_every_model_seen() -> None:
    mon = TrafficMonitor(ManualClock(1000.0))
    mon.observe_request("a", 10, 1)
    mon.observe_request("b", 20, 2)
    assert set(mon.all_stats()) == {"a", "b"}
    assert mon.all_stats()["b"].prompt.mean == 20


def test_own_arrivals_are_handed_out_once_and_never_what_was_merged() -> None:
    """What a daemon replica publishes: the requests it answered itself (after the window's
    bounds), each once, in order; never the arrivals it merged from other replicas, which
    would come back to their own publisher and be counted twice."""
    clock = ManualClock(1000.0)
    mon = TrafficMonitor(clock, TrafficConfig(window_s=60, max_requests=3))
    mon.set_context_limits({"m": 1000})
    mon.observe_request("m", 10, 1)  # before keep_own_arrivals: a sole daemon keeps nothing
    assert mon.take_own_arrivals() == []
    mon.keep_own_arrivals()
    mon.observe_request("m", 20, 5000)  # output clipped to the context, as in the window
    mon.observe_request("m", 2000, 1)  # beyond the context: neither counted nor published
    clock.advance(1)
    mon.observe_requests_at("m", [(1000.5, 30, 3.0)])  # another replica's: not ours to send
    mon.observe_request("n", 40, 4)
    assert mon.take_own_arrivals() == [("m", 1000.0, 20, 980.0), ("n", 1001.0, 40, 4.0)]
    assert mon.take_own_arrivals() == []  # handed out once
    for i in range(5):  # nobody took them for longer than max_requests: the oldest go
        mon.observe_request("m", 100 + i, 1)
    assert [p for _, _, p, _ in mon.take_own_arrivals()] == [102, 103, 104]
