"""Capturing a whole engine for a snapshot, and bringing one back from it.

The capture is three plain collections, which is exactly what the snapshot library stores:
tensor groups (weights, each live session's KV, each session's random-generator state), JSON
parts (configs, session descriptions, the queue) and opaque artifacts (the compiled-graph
cache). Restoring re-imports every session through the same path a migration uses, so a
snapshot and a live transfer cannot drift apart.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fleetshift_agent.engine.compile_cache import GRAPH_ARTIFACT, load_artifacts, save_artifacts
from fleetshift_agent.engine.config import EngineConfig, ModelConfig
from fleetshift_agent.engine.engine import Clock, Engine
from fleetshift_agent.engine.session import Session, SessionExport
from fleetshift_agent.engine.weights import build_model
from fleetshift_common.errors import AlreadyExists

COMPILE_ARTIFACT = GRAPH_ARTIFACT


@dataclass(frozen=True)
class EngineState:
    tensor_groups: dict[str, dict[str, torch.Tensor]]
    json_parts: dict[str, Any]
    artifacts: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class RestoreReport:
    sessions: tuple[str, ...]
    kv_restored: tuple[str, ...]  # sessions whose KV came back; the rest are recomputed
    compiled_artifacts_loaded: bool
    kv_mismatch: tuple[str, ...]  # platform fields that made KV unusable, if any


def capture_state(engine: Engine, *, with_artifacts: bool = True) -> EngineState:
    """Must run at a step boundary (no step in flight). Copies KV; weights are shared."""
    kv: dict[str, torch.Tensor] = {}
    rng: dict[str, torch.Tensor] = {}
    sessions: list[dict[str, Any]] = []
    for i, s in enumerate(engine.live_sessions()):
        key = f"s{i}"
        exp = engine.export_session(s.session_id, with_kv=True)
        sessions.append({"key": key, **exp.description})
        rng[key] = exp.rng_state
        if exp.k is not None and exp.v is not None:
            kv[f"{key}.k"], kv[f"{key}.v"] = exp.k, exp.v
    weights = {k: v.cpu().contiguous() for k, v in engine.model.own_tensors().items()}
    groups = {"weights": weights, "kv": kv, "rng": rng}
    json_parts = {
        "engine": {
            "config": engine.config.to_json(),
            "model_config": engine.mcfg.to_hf(),
            "model_id": engine.model_id,
            "weights_digest": engine.weights_digest,
            "platform": engine.platform(),
            "groups": sorted(k for k, v in groups.items() if v),
        },
        "sessions": sessions,
        "queue": [s.session_id for s in engine.scheduler.waiting],
    }
    artifacts = save_artifacts() if with_artifacts and engine.compiled else {}
    return EngineState({k: v for k, v in groups.items() if v}, json_parts, artifacts)


def restore_state(
    state: EngineState,
    *,
    config: EngineConfig | None = None,
    use_kv: bool = True,
    use_artifacts: bool = True,
    clock: Clock = time.monotonic,
) -> tuple[Engine, RestoreReport]:
    """A new engine holding the captured weights and sessions.

    ``config`` overrides the captured engine config (e.g. another device); KV is reused only
    when the platform matches, otherwise each session's KV is recomputed from its tokens.
    """
    meta = state.json_parts["engine"]
    cfg = config or EngineConfig.from_json(meta["config"])
    loaded = use_artifacts and cfg.compile and load_artifacts(state.artifacts)
    mcfg = ModelConfig.from_hf(meta["model_config"])
    model = build_model(
        mcfg,
        state.tensor_groups["weights"],
        dtype=cfg.dtype or mcfg.torch_dtype,
        device=cfg.device,
    )
    engine = Engine(
        model, cfg, model_id=meta["model_id"], weights_digest=meta["weights_digest"], clock=clock
    )
    mismatch = tuple(engine.kv_mismatch(meta["platform"])) if use_kv else ()
    restored = import_sessions(engine, state, meta["platform"], use_kv=use_kv)
    report = RestoreReport(
        sessions=tuple(s.session_id for s in restored),
        kv_restored=tuple(s.session_id for s in restored if s.cached),
        compiled_artifacts_loaded=loaded,
        kv_mismatch=mismatch,
    )
    return engine, report


def import_sessions(
    engine: Engine, state: EngineState, platform: Mapping[str, Any], *, use_kv: bool
) -> list[Session]:
    kv = state.tensor_groups.get("kv", {})
    rng = state.tensor_groups.get("rng", {})
    taken = [
        d["session_id"] for d in state.json_parts["sessions"] if d["session_id"] in engine.sessions
    ]
    if taken:
        raise AlreadyExists(f"session_id {taken[0]!r} already lives here", field="session_id")
    out: list[Session] = []
    for desc in state.json_parts["sessions"]:
        key = desc["key"]
        description = {k: v for k, v in desc.items() if k != "key"}
        exp = SessionExport(
            description=description,
            rng_state=rng[key],
            platform=dict(platform),
            k=kv.get(f"{key}.k"),
            v=kv.get(f"{key}.v"),
        )
        out.append(engine.import_session(exp, use_kv=use_kv))
    return out
