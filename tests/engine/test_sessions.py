"""Moving a session or a whole engine must continue with exactly the same tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fleetshift_agent.engine import SessionExport
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_agent.engine.state import capture_state, restore_state
from fleetshift_common.errors import FailedPrecondition, InvalidArgument

from .helpers import REQUESTS, add_all, drain, new_engine, run_all


def _partial(model: Path, steps: int) -> tuple[object, dict[str, list[int]]]:
    engine = new_engine(model)
    add_all(engine, REQUESTS)
    out: dict[str, list[int]] = {}
    for _ in range(steps):
        for ev in engine.step():
            out.setdefault(ev.session_id, []).append(ev.token)
    return engine, out


@pytest.mark.parametrize("with_kv", [True, False], ids=["with-kv", "tokens-only"])
def test_exported_session_continues_identically_in_another_engine(
    tiny_model: Path, with_kv: bool
) -> None:
    reference = run_all(tiny_model, REQUESTS)
    source, out = _partial(tiny_model, 5)
    dest = new_engine(tiny_model)
    for sid in REQUESTS:
        blob = source.export_session(sid, with_kv=with_kv).to_bytes()  # type: ignore[attr-defined]
        session = dest.import_session(SessionExport.from_bytes(blob))
        assert session.cached == (len(session.tokens) - 1 if with_kv else 0)
    assert drain(dest, out) == reference


def test_capture_and_restore_of_a_whole_engine_continues_every_session(tiny_model: Path) -> None:
    reference = run_all(tiny_model, REQUESTS)
    source, out = _partial(tiny_model, 4)
    state = capture_state(source)  # type: ignore[arg-type]
    engine, report = restore_state(state)
    assert set(report.sessions) == set(REQUESTS)
    assert set(report.kv_restored) == set(REQUESTS)
    assert drain(engine, out) == reference


def test_restore_on_another_row_count_recomputes_kv_and_says_why(tiny_model: Path) -> None:
    source, _ = _partial(tiny_model, 3)
    state = capture_state(source)  # type: ignore[arg-type]
    cfg = dataclasses.replace(source.config, rows=8)  # type: ignore[attr-defined]
    engine, report = restore_state(state, config=cfg)
    assert report.kv_restored == ()
    assert "rows" in report.kv_mismatch
    assert all(len(out) > 0 for out in drain(engine, {}).values())


def test_session_from_other_weights_is_refused_naming_the_digest(
    tiny_model: Path, tmp_path: Path
) -> None:
    make_model(["--out", str(tmp_path), "--preset", "tiny", "--seed", "8"])
    source, _ = _partial(tiny_model, 2)
    export = source.export_session("greedy-short", with_kv=False)  # type: ignore[attr-defined]
    other = new_engine(tmp_path)
    with pytest.raises(FailedPrecondition) as err:
        other.import_session(export)
    assert err.value.field == "weights_digest"


def test_garbage_blob_is_invalid_argument_naming_blob() -> None:
    with pytest.raises(InvalidArgument) as err:
        SessionExport.from_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert err.value.field == "blob"


def test_generator_state_travels_as_a_byte_tensor(tiny_model: Path) -> None:
    source, _ = _partial(tiny_model, 3)
    export = source.export_session("seeded-hot", with_kv=True)  # type: ignore[attr-defined]
    back = SessionExport.from_bytes(export.to_bytes())
    assert back.rng_state.dtype == torch.uint8
    assert torch.equal(back.rng_state, export.rng_state)
    assert back.k is not None and torch.equal(back.k, export.k)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"cached": 10_000}, "cached"),
        ({"session_id": ""}, "session_id"),
        ({"prompt_len": 0}, "prompt_len"),
        ({"max_new_tokens": 1}, "max_new_tokens"),
        ({"tokens": [1, 2, 99_999]}, "tokens"),
        ({"seed": "not a number"}, "blob"),
    ],
)
def test_a_doctored_session_is_refused_naming_the_field(
    tiny_model: Path, change: dict[str, object], field: str
) -> None:
    source, _ = _partial(tiny_model, 3)
    export = source.export_session("greedy-long", with_kv=True)  # type: ignore[attr-defined]
    export.description.update(change)
    dest = new_engine(tiny_model)
    with pytest.raises(InvalidArgument) as err:
        dest.import_session(SessionExport.from_bytes(export.to_bytes()))
    assert err.value.field == field
    assert not dest.has_work() and dest.kv.used_blocks == 0
