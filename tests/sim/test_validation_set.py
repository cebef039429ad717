"""The validation set keeps the tuning minutes apart and builds every trace from real requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.sim.trace import load_trace
from fleetshift_daemon.sim.validation import (
    TRACE_NAMES,
    TUNING_END_S,
    TUNING_PROCESS_NAMES,
    validation_traces,
)

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
AZURE = SHARED / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "mooncake_conversation_trace.jsonl"


def test_only_the_first_thirty_minutes_of_each_trace_are_tuning_data() -> None:
    azure = load_trace(AZURE)
    traces = {v.name: v for v in validation_traces(AZURE, MOONCAKE)}
    assert list(traces) == list(TRACE_NAMES)
    tuning = ["azure-0-30", "mooncake-0-30", "tuning-a-then-m", "tuning-m-then-a"]
    assert [n for n, v in traces.items() if v.tuning] == tuning
    moon = load_trace(MOONCAKE)
    moon_late = moon.window(TUNING_END_S, np.inf)
    assert np.array_equal(traces["mooncake"].trace.prompt_tokens, moon_late.prompt_tokens)
    assert traces["mooncake-0-30"].trace.duration_s < TUNING_END_S
    for name in tuning[2:]:  # tuning shifts: only tuning minutes' requests
        v = traces[name]
        assert v.trace.duration_s < TUNING_END_S, name
        assert v.switch_s is not None and 0 < v.switch_s < v.trace.duration_s, name
    tune, held = traces["azure-0-30"].trace, traces["azure-30-58"].trace
    assert tune.duration_s < TUNING_END_S and len(tune) + len(held) == len(azure)
    late = azure.window(TUNING_END_S, np.inf)
    assert np.array_equal(held.prompt_tokens, late.prompt_tokens)
    for name in ("poisson", "on-off", "ramp"):  # held-out requests, new arrival times
        synth = traces[name].trace
        assert np.array_equal(synth.prompt_tokens, late.prompt_tokens), name
        assert not np.array_equal(synth.arrival_s, held.arrival_s), name
    assert traces["mooncake"].model == "llama31-70b" and traces["mooncake"].over_window == 0
    assert traces["azure-30-58"].model == "llama2-70b"
    assert traces["azure-30-58"].over_window == int(
        (late.prompt_tokens + late.output_tokens > 4096).sum()
    )


def test_the_tuning_analogs_of_the_synthetic_processes_use_only_tuning_requests() -> None:
    tune = validation_traces(AZURE, MOONCAKE, ("azure-0-30",))[0].trace
    for v in validation_traces(AZURE, MOONCAKE, TUNING_PROCESS_NAMES):
        assert v.tuning, v.name
        assert np.array_equal(v.trace.prompt_tokens, tune.prompt_tokens), v.name
        assert not np.array_equal(v.trace.arrival_s, tune.arrival_s), v.name
    with pytest.raises(InvalidArgument, match="unknown validation trace 'ramp-30-60'"):
        validation_traces(AZURE, MOONCAKE, ("ramp-30-60",))


def test_shifts_switch_service_at_half_and_time_compression_moves_the_switch() -> None:
    traces = {v.name: v for v in validation_traces(AZURE, MOONCAKE, span_s=600.0)}
    for name, first_long in (
        ("azure-then-mooncake", False),
        ("mooncake-then-azure", True),
        ("tuning-a-then-m", False),
        ("tuning-m-then-a", True),
    ):
        v = traces[name]
        assert v.switch_s == pytest.approx(300.0, abs=5.0)
        before = v.trace.window(0.0, v.switch_s).prompt_tokens.mean()
        after = v.trace.window(v.switch_s, np.inf).prompt_tokens.mean()
        assert (before > 4 * after) if first_long else (after > 4 * before), name
        fast = v.compressed(4.0)
        assert fast.switch_s == pytest.approx(v.switch_s / 4)
        assert fast.trace.duration_s == pytest.approx(v.trace.duration_s / 4)
    for v in traces.values():  # every trace cut to the span
        assert v.trace.duration_s <= 600.0, v.name
    with pytest.raises(InvalidArgument, match="unknown validation trace"):
        validation_traces(AZURE, MOONCAKE, names=("azure", "mooncake"))
