"""The seeded tiny model every engine test runs on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetshift_agent.engine.make_model import main as make_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    assert make_model(["--out", str(out), "--preset", "tiny", "--seed", "7"]) == 0
    return out
