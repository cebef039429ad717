"""A session's tokens must not depend on what else shares its batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import REQUESTS, add_all, drain, new_engine, run_all


@pytest.mark.parametrize("sid", sorted(REQUESTS))
def test_session_alone_and_in_a_batch_of_four_give_identical_tokens(
    tiny_model: Path, sid: str
) -> None:
    batched = run_all(tiny_model, REQUESTS)
    alone = run_all(tiny_model, {sid: REQUESTS[sid]})
    assert len(batched[sid]) == REQUESTS[sid][1]
    assert alone[sid] == batched[sid]


def test_session_joining_mid_run_does_not_change_the_others(tiny_model: Path) -> None:
    reference = run_all(tiny_model, REQUESTS)
    engine = new_engine(tiny_model)
    first, *rest = sorted(REQUESTS)
    engine.add_session(first, *REQUESTS[first])
    out: dict[str, list[int]] = {}
    for ev in engine.step() + engine.step() + engine.step():
        out.setdefault(ev.session_id, []).append(ev.token)
    for sid in rest:  # joins between steps, while the first is decoding
        engine.add_session(sid, *REQUESTS[sid])
    assert drain(engine, out) == reference


def test_seeded_sessions_differ_by_seed_and_repeat_by_seed(tiny_model: Path) -> None:
    prompt, n, params = REQUESTS["seeded-hot"]
    again = run_all(tiny_model, {"x": (prompt, n, params)})["x"]
    other_seed = type(params)(temperature=params.temperature, top_p=params.top_p, seed=12)
    other = run_all(tiny_model, {"x": (prompt, n, other_seed)})["x"]
    assert again == run_all(tiny_model, {"y": (prompt, n, params)})["y"]
    assert other != again


def test_a_tiny_kv_pool_preempts_and_recomputes_without_changing_tokens(tiny_model: Path) -> None:
    reference = run_all(tiny_model, REQUESTS)
    engine = new_engine(tiny_model, num_blocks=9, block_size=8)

    add_all(engine, REQUESTS)
    assert drain(engine, {}) == reference
    assert engine.counters().preemptions > 0
    assert engine.counters().kv_blocks_used == 0
