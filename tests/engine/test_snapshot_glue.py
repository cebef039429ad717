"""Engine state through the snapshot library: warm where the key allows, recomputed where not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_agent.engine.state import capture_state
from fleetshift_agent.snapshot import SnapshotIncompatible, open_snapshot
from fleetshift_agent.worker.snapshots import (
    engine_from_snapshot,
    engine_key,
    import_snapshot_sessions,
    write_engine_snapshot,
)

from .helpers import REQUESTS, add_all, drain, new_engine, run_all


def _half_run(model: Path) -> tuple[object, dict[str, list[int]]]:
    engine = new_engine(model)
    add_all(engine, REQUESTS)
    out: dict[str, list[int]] = {}
    for _ in range(5):
        for ev in engine.step():
            out.setdefault(ev.session_id, []).append(ev.token)
    return engine, out


def test_snapshot_restores_warm_on_the_same_platform(tiny_model: Path, tmp_path: Path) -> None:
    reference = run_all(tiny_model, REQUESTS)
    engine, out = _half_run(tiny_model)
    info = write_engine_snapshot(capture_state(engine), engine_key(engine), tmp_path, "warm")  # type: ignore[arg-type]
    snap = open_snapshot(info.path)
    snap.verify()
    assert snap.key == engine_key(engine)  # type: ignore[arg-type]
    restored = engine_from_snapshot(snap)
    assert restored.verdict.warm_ok
    assert set(restored.report.kv_restored) == set(REQUESTS)
    assert drain(restored.engine, out) == reference


def test_snapshot_from_another_gpu_recomputes_kv_and_still_continues_exactly(
    tiny_model: Path, tmp_path: Path
) -> None:
    reference = run_all(tiny_model, REQUESTS)
    engine, out = _half_run(tiny_model)
    foreign = dataclasses.replace(engine_key(engine), gpu_product="NVIDIA H100 80GB HBM3")  # type: ignore[arg-type]
    info = write_engine_snapshot(capture_state(engine), foreign, tmp_path, "cold")  # type: ignore[arg-type]
    restored = engine_from_snapshot(open_snapshot(info.path))
    assert restored.verdict.differing_fields == ("gpu_product",)
    assert restored.verdict.weights_reusable and not restored.verdict.warm_ok
    assert restored.report.kv_restored == ()  # carried as token history, KV recomputed
    assert drain(restored.engine, out) == reference


def test_sessions_refuse_other_weights_naming_the_digest(tiny_model: Path, tmp_path: Path) -> None:
    engine, _ = _half_run(tiny_model)
    info = write_engine_snapshot(capture_state(engine), engine_key(engine), tmp_path, "s")  # type: ignore[arg-type]
    other_dir = tmp_path / "other-model"
    make_model(["--out", str(other_dir), "--preset", "tiny", "--seed", "99"])
    other = new_engine(other_dir)
    with pytest.raises(SnapshotIncompatible) as err:
        import_snapshot_sessions(other, open_snapshot(info.path))
    assert "weights_digest" in str(err.value)
    assert not other.has_work()
