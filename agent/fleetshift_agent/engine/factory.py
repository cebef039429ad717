"""Building an engine from a model directory, the cold-start path."""

from __future__ import annotations

import time
from pathlib import Path

from fleetshift_agent.engine.config import EngineConfig
from fleetshift_agent.engine.engine import Clock, Engine
from fleetshift_agent.engine.weights import load_model_dir, weights_digest


def engine_from_dir(
    model_dir: Path,
    config: EngineConfig,
    *,
    model_id: str = "",
    clock: Clock = time.monotonic,
) -> Engine:
    model = load_model_dir(model_dir, dtype=config.dtype, device=config.device)
    return Engine(
        model,
        config,
        model_id=model_id or model_dir.resolve().name,
        weights_digest=weights_digest(model_dir),
        clock=clock,
    )
