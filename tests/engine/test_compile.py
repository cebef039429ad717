"""torch.compile must not change a single token."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_agent.engine.config import compile_enabled_by_env
from fleetshift_agent.engine.state import COMPILE_ARTIFACT, capture_state, restore_state

from .helpers import REQUESTS, add_all, drain, new_engine, run_all


def test_compiled_engine_gives_the_eager_tokens_and_snapshots_its_graphs(
    tiny_model: Path,
) -> None:
    eager = run_all(tiny_model, REQUESTS)
    engine = new_engine(tiny_model, compile=True)
    assert engine.compiled
    add_all(engine, REQUESTS)
    out: dict[str, list[int]] = {}
    for _ in range(4):
        for ev in engine.step():
            out.setdefault(ev.session_id, []).append(ev.token)
    state = capture_state(engine)
    assert len(state.artifacts[COMPILE_ARTIFACT]) > 0
    restored, report = restore_state(state)
    assert report.compiled_artifacts_loaded and restored.compiled
    assert drain(restored, {k: list(v) for k, v in out.items()}) == eager
    assert drain(engine, out) == eager


def test_env_switch_turns_compilation_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETSHIFT_COMPILE", "0")
    assert compile_enabled_by_env(True) is False
    monkeypatch.setenv("FLEETSHIFT_COMPILE", "1")
    assert compile_enabled_by_env(False) is True
    monkeypatch.delenv("FLEETSHIFT_COMPILE")
    assert compile_enabled_by_env(True) is True
