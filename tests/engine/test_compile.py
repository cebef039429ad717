"""torch.compile must not change a single token."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_agent.engine.config import compile_enabled_by_env

from .helpers import REQUESTS, add_all, drain, new_engine, run_all


def test_compiled_engine_gives_the_eager_tokens(tiny_model: Path) -> None:
    eager = run_all(tiny_model, REQUESTS)
    engine = new_engine(tiny_model, compile=True)
    assert engine.compiled
    add_all(engine, REQUESTS)
    assert drain(engine, {}) == eager


def test_env_switch_turns_compilation_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETSHIFT_COMPILE", "0")
    assert compile_enabled_by_env(True) is False
    monkeypatch.setenv("FLEETSHIFT_COMPILE", "1")
    assert compile_enabled_by_env(False) is True
    monkeypatch.delenv("FLEETSHIFT_COMPILE")
    assert compile_enabled_by_env(True) is True
