"""The trace loader takes any CSV of the Azure columns and names the line and column at fault."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.perfmodel import (
    CONTEXT_WINDOWS,
    PRESETS,
    Deployment,
    PerfModel,
    llama2_70b,
    llama31_70b,
)
from fleetshift_daemon.models import PRESETS as DAEMON_PRESETS
from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.trace import (
    Phase,
    Shape,
    TraceFormatError,
    fit_context,
    load_trace,
    prefix_reuse_tokens,
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


# ----- Mooncake JSON lines ------------------------------------------------------------------

MOONCAKE = SHARED / "traces" / "mooncake_conversation_trace.jsonl"


def write_jsonl(tmp_path: Path, text: str, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_loads_mooncake_json_lines_keeping_the_prefix_hashes(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path,
        '{"timestamp": 2500, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]}\n'
        "\n"
        '{"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 5]}\n',
    )
    trace = load_trace(path)
    assert list(trace.arrival_s) == [0.0, 1.5]  # ms to s, sorted, relative to the first
    assert list(trace.prompt_tokens) == [600, 1024]
    assert list(trace.output_tokens) == [3, 7]
    assert trace.hash_ids is not None
    assert [list(h) for h in trace.hash_ids] == [[0, 5], [0, 1]]
    kept = trace.window(1.0, 2.0)  # reshaping keeps each request's hashes with it
    assert kept.hash_ids is not None and list(kept.hash_ids[0]) == [0, 1]


def test_the_format_is_told_by_content_when_the_name_does_not_say(tmp_path: Path) -> None:
    jsonl = write_jsonl(
        tmp_path, '{"timestamp": 0, "input_length": 9, "output_length": 2}\n', "trace.txt"
    )
    csv_file = write_jsonl(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n0,9,2\n", "t.log")
    assert load_trace(jsonl).hash_ids is None and list(load_trace(jsonl).prompt_tokens) == [9]
    assert list(load_trace(csv_file).prompt_tokens) == [9]


def test_loads_the_real_mooncake_trace_and_its_first_lines(tmp_path: Path) -> None:
    head = write_jsonl(tmp_path, "".join(MOONCAKE.open().readlines()[:50]))
    first = load_trace(head)
    assert len(first) == 50
    assert first.prompt_tokens[0] == 6758 and first.output_tokens[0] == 500
    assert first.hash_ids is not None and list(first.hash_ids[0][:3]) == [0, 1, 2]
    trace = load_trace(MOONCAKE)
    assert len(trace) == 12031
    assert 3400 < trace.duration_s < 3700
    assert round(trace.prompt_tokens.mean()) == 12035 and trace.prompt_tokens.max() == 126195
    assert trace.output_tokens.max() == 2000
    # a 512-token block per hash: the hashes cover the prompt
    blocks = np.array([len(h) for h in trace.hash_ids])
    assert np.all(blocks == np.ceil(trace.prompt_tokens / 512))


@pytest.mark.parametrize(
    ("body", "line", "column"),
    [
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,', 2, "json"),
        ('{"timestamp": 0, "input_length": 5}\n', 1, "output_length"),
        ('{"timestamp": "soon", "input_length": 5, "output_length": 1}\n', 1, "timestamp"),
        ('{"timestamp": -4, "input_length": 5, "output_length": 1}\n', 1, "timestamp"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n', 1, "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 0}\n', 1, "output_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": true}\n', 1, "output_length"),
        ("[1, 2, 3]\n", 1, "json"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n',
            2,
            "hash_ids",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 1, "input_length": 5, "output_length": 1}\n',
            2,
            "hash_ids",
        ),
        ("\n\n", 1, "timestamp"),
    ],
)
def test_rejects_malformed_json_lines_naming_line_and_field(
    tmp_path: Path, body: str, line: int, column: str
) -> None:
    with pytest.raises(TraceFormatError) as err:
        load_trace(write_jsonl(tmp_path, body))
    assert err.value.line == line
    assert err.value.column == column
    assert f"line {line}" in str(err.value) and column in str(err.value)


def test_requests_beyond_the_context_window_are_refused_and_counted() -> None:
    trace = load_trace(MOONCAKE)
    short = fit_context(trace, 4096)  # Llama-2-70B's window
    long = fit_context(trace, CONTEXT_WINDOWS["llama31-70b"])
    total = trace.prompt_tokens + trace.output_tokens
    assert short.refused == int((total > 4096).sum()) > len(trace) // 2
    assert len(short.trace) + short.refused == len(trace)
    assert np.all(short.trace.prompt_tokens + short.trace.output_tokens <= 4096)
    assert long.refused == 0 and len(long.trace) == len(trace)
    with pytest.raises(InvalidArgument):
        fit_context(trace, 0)


def test_the_long_context_preset_has_llama2_70bs_shape_and_llama3s_vocabulary() -> None:
    l2, l3 = llama2_70b(), llama31_70b()
    assert l3.vocab == 128256 and l2.vocab == 32000
    same = ("n_layers", "hidden", "n_heads", "n_kv_heads", "intermediate", "head_dim")
    assert all(getattr(l2, f) == getattr(l3, f) for f in same)
    model = PerfModel()
    a100 = default_catalogue().get("A100-SXM-80GB")
    d2 = Deployment(l2, a100, 8)
    d3 = Deployment(l3, a100, 8)
    # a bigger vocabulary: more weights, less KV room, same KV per token
    assert model.kv_bytes_per_token(d3) == model.kv_bytes_per_token(d2)
    assert model.kv_capacity_tokens(d3) < model.kv_capacity_tokens(d2)
    assert model.kv_capacity_tokens(d3) > 126195 + 2000  # the longest Mooncake request fits
    assert PRESETS["llama31-70b"]().vocab == 128256
    assert DAEMON_PRESETS["llama31-70b"]().vocab == 128256
    fleet = standard_fleet(preset="llama31-70b")
    assert fleet.context_window == 131072 and fleet.arch.name == "llama31-70b"


def test_prefix_reuse_counts_the_leading_blocks_seen_before(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path,
        '{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 1, "input_length": 1200, "output_length": 1, "hash_ids": [0, 1, 9]}\n'
        '{"timestamp": 2, "input_length": 700, "output_length": 1, "hash_ids": [5, 1]}\n'
        '{"timestamp": 3, "input_length": 1000, "output_length": 1, "hash_ids": [0, 1]}\n',
    )
    # the first is new; the second shares two blocks; the third none (a block in the middle
    # of another prompt is no prefix); the fourth two blocks, capped at its own prompt
    assert list(prefix_reuse_tokens(load_trace(path))) == [0, 1024, 0, 1000]
    with pytest.raises(InvalidArgument, match="hash_ids"):
        prefix_reuse_tokens(load_trace(AZURE).head(10))
