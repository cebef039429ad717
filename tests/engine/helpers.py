"""Requests and helpers to run engines to completion."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fleetshift_agent.engine import Engine, EngineConfig, SamplingParams
from fleetshift_agent.engine.factory import engine_from_dir

Request = tuple[list[int], int, SamplingParams]

# The torch device the engine tests compute on: the CPU, or with FLEETSHIFT_TEST_DEVICE=cuda
# a GPU (the in-process engines and the worker processes alike, so that every reference run
# is on the same device as what it is compared with). bench/gpu_engine_tests.sh sets it.
DEVICE = os.environ.get("FLEETSHIFT_TEST_DEVICE", "cpu")

# Two greedy and two seeded sessions with different prompt lengths (one spans blocks).
REQUESTS: dict[str, Request] = {
    "greedy-short": ([1, 2, 3, 4, 5], 14, SamplingParams()),
    "greedy-long": (list(range(3, 43)), 14, SamplingParams()),
    "seeded-topp": ([7] * 20, 14, SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
    "seeded-hot": ([9, 8, 7], 14, SamplingParams(temperature=1.3, seed=11)),
}


def new_engine(model_dir: Path, **overrides: object) -> Engine:
    cfg = EngineConfig(**{"num_blocks": 64, "compile": False, "device": DEVICE, **overrides})  # type: ignore[arg-type]
    return engine_from_dir(model_dir, cfg)


def add_all(engine: Engine, requests: Mapping[str, Request]) -> None:
    for sid, (prompt, n, params) in requests.items():
        engine.add_session(sid, prompt, n, params)


def drain(engine: Engine, out: dict[str, list[int]]) -> dict[str, list[int]]:
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.session_id, []).append(ev.token)
    return out


def run_all(
    model_dir: Path, requests: Mapping[str, Request], **overrides: object
) -> dict[str, list[int]]:
    engine = new_engine(model_dir, **overrides)
    add_all(engine, requests)
    return drain(engine, {})
