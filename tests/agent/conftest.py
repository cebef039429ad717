"""One tiny model per test module: the agent tests start real workers on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_agent.engine.make_model import main as make_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    assert make_model(["--out", str(out), "--preset", "tiny", "--seed", "1"]) == 0
    return out
