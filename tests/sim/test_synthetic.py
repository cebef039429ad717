"""Synthetic arrival processes keep the real requests; service shifts splice two real traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.sim.synthetic import (
    BURST_PEAK,
    BURST_PERIOD_S,
    BURST_S,
    RAMP_FROM,
    RAMP_TO,
    on_off_intensity,
    service_shift,
    with_arrivals,
)
from fleetshift_daemon.sim.trace import Trace, load_trace

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
AZURE = SHARED / "traces" / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.fixture(scope="module")
def azure() -> Trace:
    return load_trace(AZURE)


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load_trace(MOONCAKE)


@pytest.mark.parametrize("process", ["poisson", "on-off", "ramp"])
def test_a_process_keeps_every_request_its_order_and_the_mean_rate(
    azure: Trace, process: str
) -> None:
    synth = with_arrivals(azure, process, seed=4)
    assert np.array_equal(synth.prompt_tokens, azure.prompt_tokens)
    assert np.array_equal(synth.output_tokens, azure.output_tokens)
    assert np.all(np.diff(synth.arrival_s) >= 0) and synth.arrival_s[0] == 0.0
    assert synth.duration_s == pytest.approx(azure.duration_s, rel=0.01)
    again = with_arrivals(azure, process, seed=4)
    other = with_arrivals(azure, process, seed=5)
    assert np.array_equal(again.arrival_s, synth.arrival_s)
    assert not np.array_equal(other.arrival_s, synth.arrival_s)


def test_poisson_gaps_are_exponential_at_the_mean_rate(azure: Trace) -> None:
    gaps = np.diff(with_arrivals(azure, "poisson", seed=1).arrival_s)
    mean_gap = azure.duration_s / len(azure)
    assert gaps.mean() == pytest.approx(mean_gap, rel=0.02)
    assert gaps.std() == pytest.approx(mean_gap, rel=0.05)  # exponential: std = mean
    per_min = np.histogram(with_arrivals(azure, "poisson", seed=1).arrival_s, bins=58)[0]
    assert per_min.var() / per_min.mean() == pytest.approx(1.0, abs=0.5)  # Poisson counts


def test_on_off_bursts_peak_at_ten_times_the_mean(azure: Trace) -> None:
    rng = np.random.default_rng(2)
    edges, rates = on_off_intensity(azure.duration_s, rng)
    mean = float((rates * np.diff(edges)).sum() / azure.duration_s)
    assert mean == pytest.approx(1.0, rel=0.02)
    assert rates.max() == BURST_PEAK
    synth = with_arrivals(azure, "on-off", seed=2)
    rate = len(azure) / azure.duration_s
    t = synth.arrival_s
    sliding = np.searchsorted(t, t + BURST_S) - np.arange(len(t))  # arrivals in [t, t + 15 s)
    cycles = (t // BURST_PERIOD_S).astype(int)
    full = int(synth.duration_s // BURST_PERIOD_S)
    peaks = np.array([sliding[cycles == c].max() for c in range(full)])
    assert peaks.mean() / BURST_S / rate == pytest.approx(BURST_PEAK, rel=0.15)
    grid = np.arange(0.0, synth.duration_s - BURST_S, 1.0)
    over_time = np.searchsorted(t, grid + BURST_S) - np.searchsorted(t, grid)
    assert np.median(over_time) / BURST_S / rate < 0.7  # quiet between bursts


def test_the_ramp_rises_from_a_quarter_to_seven_quarters_of_the_mean(azure: Trace) -> None:
    synth = with_arrivals(azure, "ramp", seed=3)
    rate = len(azure) / azure.duration_s
    tenth = azure.duration_s / 10
    first = len(synth.window(0.0, tenth)) / tenth / rate
    last = len(synth.window(synth.duration_s - tenth, np.inf)) / tenth / rate
    assert first == pytest.approx(RAMP_FROM + (RAMP_TO - RAMP_FROM) * 0.05, abs=0.1)
    assert last == pytest.approx(RAMP_FROM + (RAMP_TO - RAMP_FROM) * 0.95, abs=0.15)


def test_an_unknown_process_or_an_empty_trace_is_refused(azure: Trace) -> None:
    with pytest.raises(InvalidArgument, match="arrival process"):
        with_arrivals(azure, "bursty", seed=0)
    with pytest.raises(InvalidArgument, match="duration"):
        with_arrivals(azure.head(1), "poisson", seed=0)


def test_a_service_shift_is_one_real_trace_then_the_other(azure: Trace, mooncake: Trace) -> None:
    half = min(azure.duration_s, mooncake.duration_s) / 2
    for first, second in ((azure, mooncake), (mooncake, azure)):
        mixed = service_shift(first, second)
        head = mixed.window(0.0, half)
        tail = mixed.window(half, np.inf)
        assert np.array_equal(head.arrival_s, first.window(0.0, half).arrival_s)
        assert np.array_equal(head.prompt_tokens, first.window(0.0, half).prompt_tokens)
        assert np.array_equal(tail.arrival_s, second.window(half, np.inf).arrival_s)
        assert np.array_equal(tail.output_tokens, second.window(half, np.inf).output_tokens)
        assert mixed.hash_ids is None  # Azure has none, so the splice has none
    conv_then_kimi = service_shift(azure, mooncake)
    before = conv_then_kimi.window(0.0, half).prompt_tokens.mean()
    after = conv_then_kimi.window(half, np.inf).prompt_tokens.mean()
    assert after > 5 * before  # Mooncake's prompts are ten times Azure's
    with pytest.raises(InvalidArgument, match="switch time"):
        service_shift(azure, mooncake, switch_s=mooncake.duration_s + 1)
