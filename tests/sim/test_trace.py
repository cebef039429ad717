"""The trace loader takes any CSV of the Azure columns and names the line and column at fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetshift_daemon.sim.trace import (
    Phase,
    Shape,
    TraceFormatError,
    load_trace,
    shifting_mix,
)

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
AZURE = SHARED / "traces" / "azure_llm_2023_conv.csv"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.csv"
    path.write_text(text)
    return path


def test_loads_the_real_azure_trace() -> None:
    trace = load_trace(AZURE)
    assert len(trace) == 19366
    assert trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0)
    assert 3400 < trace.duration_s < 3600  # about one hour
    assert trace.prompt_tokens[0] == 374 and trace.output_tokens[0] == 44


def test_accepts_any_csv_with_the_three_columns_in_any_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "GeneratedTokens,extra,TIMESTAMP,ContextTokens\n5,x,12.5,100\n7,y,10.0,200\n",
    )
    trace = load_trace(path)
    assert list(trace.arrival_s) == [0.0, 2.5]  # sorted, relative to the first
    assert list(trace.prompt_tokens) == [200, 100]
    assert list(trace.output_tokens) == [7, 5]


@pytest.mark.parametrize(
    ("body", "line", "column"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,5\n2.0,abc,5\n", 3, "ContextTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,5\nnoon,10,5\n", 3, "TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,0\n", 2, "GeneratedTokens"),
        ("TIMESTAMP,ContextTokens\n1.0,10\n", 1, "GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,5\n\n4.0,10\n", 4, "TIMESTAMP"),
    ],
)
def test_rejects_a_malformed_file_naming_line_and_column(
    tmp_path: Path, body: str, line: int, column: str
) -> None:
    with pytest.raises(TraceFormatError) as err:
        load_trace(write(tmp_path, body))
    assert err.value.line == line
    assert err.value.column == column
    assert f"line {line}" in str(err.value) and column in str(err.value)


def test_rate_scaling_multiplies_requests_and_keeps_the_duration() -> None:
    trace = load_trace(AZURE)
    doubled = trace.rate_scaled(2.0, seed=1)
    assert len(doubled) == 2 * len(trace)
    assert doubled.duration_s <= trace.duration_s
    assert doubled.duration_s > 0.99 * trace.duration_s
    half = trace.rate_scaled(0.5, seed=1)
    assert abs(len(half) - len(trace) / 2) < 0.02 * len(trace)
    again = trace.rate_scaled(2.5, seed=1)
    assert np.array_equal(again.arrival_s, trace.rate_scaled(2.5, seed=1).arrival_s)


def test_time_compression_shortens_the_trace() -> None:
    trace = load_trace(AZURE)
    fast = trace.time_compressed(4.0)
    assert len(fast) == len(trace)
    assert fast.duration_s == pytest.approx(trace.duration_s / 4)


def test_shifting_mix_moves_from_prefill_heavy_to_decode_heavy() -> None:
    trace = load_trace(AZURE)
    mixed = shifting_mix(
        trace,
        [Phase(0.5, Shape.PREFILL_HEAVY), Phase(0.5, Shape.DECODE_HEAVY, output_scale=2.0)],
        seed=3,
    )
    half = trace.duration_s / 2
    first = mixed.window(0, half)
    second = mixed.window(half, trace.duration_s + 1)
    ratio_first = first.prompt_tokens.sum() / first.output_tokens.sum()
    ratio_second = second.prompt_tokens.sum() / second.output_tokens.sum()
    assert ratio_first > 4 * ratio_second
    assert np.array_equal(mixed.arrival_s, trace.arrival_s)
