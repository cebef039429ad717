"""The worker's side of snapshots: its compatibility key, and engine state in and out.

The engine captures plain tensors, JSON and bytes; this module puts them into the snapshot
library's format under a key that says where they came from, and on the way back decides,
from the key comparison alone, how much may be reused: KV only on an identical platform,
compiled graphs only on the same platform, weights whenever the model fields match.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fleetshift_agent.engine import ENGINE_NAME, ENGINE_VERSION, Engine, EngineConfig
from fleetshift_agent.engine.engine import Clock
from fleetshift_agent.engine.state import (
    EngineState,
    RestoreReport,
    import_sessions,
    restore_state,
)
from fleetshift_agent.snapshot import Snapshot, SnapshotIncompatible, SnapshotInfo, write_snapshot
from fleetshift_common.compat import CompatKey, CompatVerdict, compare

SPEC_KIND = "fleetshift-worker"

# The GPU product a CPU worker stands in for (``--declared-gpu``, set once at start): two
# declared H100 nodes of a CPU test fleet then share a key and an H100 and an H200 do not,
# exactly as real hardware would behave.
_declared_gpu = ""


def declare_gpu(product: str) -> None:
    global _declared_gpu
    _declared_gpu = product


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML on this machine: the key says so
        return "unknown"


def platform_fields(device: torch.device) -> dict[str, object]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        gpu = {
            "gpu_product": torch.cuda.get_device_name(index),
            "gpu_count": 1,
            "compute_capability": f"{major}.{minor}",
            "driver_version": _driver_version(),
            "cuda_version": str(torch.version.cuda),
        }
    else:
        product = f"{_declared_gpu} (declared)" if _declared_gpu else f"cpu: {_cpu_name()}"
        gpu = {
            "gpu_product": product,
            "gpu_count": 1,
            "compute_capability": "none",
            "driver_version": "none",
            "cuda_version": "none",
        }
    return {
        **gpu,
        "torch_version": torch.__version__,
        "engine_name": ENGINE_NAME,
        "engine_version": ENGINE_VERSION,
    }


def engine_key(engine: Engine) -> CompatKey:
    return CompatKey.from_json(
        {
            **platform_fields(engine.device),
            "model_id": engine.model_id,
            "weights_digest": engine.weights_digest,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": "none",
            "tensor_parallel": 1,
        }
    )


def write_engine_snapshot(
    state: EngineState, key: CompatKey, root: Path, snapshot_id: str
) -> SnapshotInfo:
    spec = {
        "kind": SPEC_KIND,
        "sessions": len(state.json_parts["sessions"]),
        "queue": len(state.json_parts["queue"]),
        "compiled_artifacts": sorted(state.artifacts),
    }
    return write_snapshot(
        root,
        snapshot_id,
        key=key,
        spec=spec,
        tensor_groups=state.tensor_groups,
        json_parts=state.json_parts,
        artifacts=state.artifacts,
    )


def _read_state(
    snap: Snapshot, *, weights: bool, artifacts: bool, sessions: bool = True
) -> EngineState:
    # Every restore (--restore-from, the Restore RPC, the agent's StartWorker with a snapshot
    # id) reads through here: nothing outside the manifest gets past this line.
    snap.check_listing()
    wanted = (["kv", "rng"] if sessions else []) + (["weights"] if weights else [])
    groups = {g: snap.load_tensors(g) for g in wanted if g in snap.tensor_groups}
    parts = {p: snap.load_json(p) for p in ("engine", "sessions", "queue")}
    if not sessions:  # weights and compiled graphs only; sessions move one by one
        parts["sessions"], parts["queue"] = [], []
    blobs = {name: snap.load_artifact(name) for name in snap.artifacts} if artifacts else {}
    return EngineState(groups, parts, blobs)


@dataclass(frozen=True)
class Restored:
    engine: Engine
    report: RestoreReport
    verdict: CompatVerdict


def engine_from_snapshot(
    snap: Snapshot,
    *,
    device: str = "",
    compile: bool | None = None,
    use_artifacts: bool = False,  # generated code: only for a store trusted like code
    sessions: bool = True,
    clock: Clock = time.monotonic,
) -> Restored:
    """A new engine from a snapshot's own weights; warm where the key allows, else recomputed."""
    skey = snap.key
    dest = CompatKey.from_json(
        {
            **skey.to_json(),
            **platform_fields(torch.device(device or "cpu")),
        }
    )
    verdict = compare(skey, dest)
    state = _read_state(
        snap, weights=True, artifacts=use_artifacts and verdict.compiled_ok, sessions=sessions
    )
    saved = EngineConfig.from_json(state.json_parts["engine"]["config"])
    overrides = {"device": device or saved.device}
    if compile is not None:
        overrides["compile"] = compile
    cfg = EngineConfig.from_json({**saved.to_json(), **overrides})
    engine, report = restore_state(
        state, config=cfg, use_kv=verdict.warm_ok, use_artifacts=use_artifacts, clock=clock
    )
    return Restored(engine, report, verdict)


def import_snapshot_sessions(engine: Engine, snap: Snapshot) -> tuple[RestoreReport, CompatVerdict]:
    """Adds a snapshot's sessions to a running engine; its weights must be the same."""
    verdict = snap.check_compat(engine_key(engine))
    if not verdict.weights_reusable:
        raise SnapshotIncompatible(snap.snapshot_id, verdict)
    state = _read_state(snap, weights=False, artifacts=False)
    platform_ = state.json_parts["engine"]["platform"]
    sessions = import_sessions(engine, state, platform_, use_kv=verdict.warm_ok)
    report = RestoreReport(
        sessions=tuple(s.session_id for s in sessions),
        kv_restored=tuple(s.session_id for s in sessions if s.cached),
        compiled_artifacts_loaded=False,
        kv_mismatch=tuple(engine.kv_mismatch(platform_)),
    )
    return report, verdict
