"""The locally made tokenizer: sized to the model, every id decodes, text round-trips, and
streaming deltas (one per token) join to the same text."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleetshift_gateway.tokenizer import ModelTokenizer

from fleetshift_agent.engine.make_model import PRESETS
from fleetshift_agent.engine.make_model import main as make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    out = tmp_path_factory.mktemp("tiny")
    assert make_model(["--out", str(out), "--preset", "tiny"]) == 0
    return ModelTokenizer.load("tiny", out)


def test_vocabulary_and_context_match_the_model(tiny: ModelTokenizer) -> None:
    assert tiny.tokenizer.get_vocab_size() == PRESETS["tiny"].vocab_size
    assert tiny.context_tokens == PRESETS["tiny"].max_position_embeddings
    assert all(tiny.decode([i]) for i in range(PRESETS["tiny"].vocab_size))


@pytest.mark.parametrize("text", ["hello fleet worker", "naïve café ✓ 漢字", "  spaces\n\ttabs"])
def test_text_round_trips(tiny: ModelTokenizer, text: str) -> None:
    ids = tiny.encode(text)
    assert all(0 <= i < PRESETS["tiny"].vocab_size for i in ids)
    assert tiny.decode(ids) == text


def test_stream_deltas_join_to_the_whole_text(tiny: ModelTokenizer) -> None:
    ids = tiny.encode("a move keeps every token: ✓ é 漢")
    decoder = tiny.stream_decoder()
    deltas = [decoder.push(i) for i in ids]
    deltas[-1] += decoder.flush()
    assert len(deltas) == len(ids) and "".join(deltas) == tiny.decode(ids)
    assert "\ufffd" not in "".join(deltas)


def test_same_tokenizer_on_every_run(tmp_path: Path, tiny: ModelTokenizer) -> None:
    assert make_model(["--out", str(tmp_path), "--preset", "tiny"]) == 0
    again = ModelTokenizer.load("tiny", tmp_path)
    assert again.tokenizer.to_str() == tiny.tokenizer.to_str()
