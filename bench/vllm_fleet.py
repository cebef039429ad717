"""What the vLLM benches share: a tiny model made here, a local fleet whose workers run vLLM's
CPU build, and a hard deadline so that no bench can hang.

Not a bench itself. The model is ``make_model --preset tiny-vllm`` (as in tests/vllm) with
its ``max_position_embeddings`` raised to what a bench's context needs: it is a Llama with
rotary positions, so the weights do not depend on the window, and vLLM's window is then
``max_model_len``. vLLM runs from ``.venv-vllm`` (``scripts/vllm-env.sh`` makes it), float32,
eager, one OpenMP thread per server, as in tests/vllm.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec

REPO = Path(__file__).resolve().parents[1]
KV_MODEL = "vllm-kv"  # FleetShift's disk KV connector: moves carry KV
RC_MODEL = "vllm-rc"  # no connector: moves carry token history, the target recomputes
KV_STORE = "kv-store"


def vllm_python() -> str:
    path = os.environ.get("FLEETSHIFT_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(path).is_file():
        sys.exit(
            f"no vLLM interpreter at {path}: `bash scripts/test-vllm` (or vllm-env.sh) makes it"
        )
    return path


def deadline(seconds: float) -> None:
    """End the whole bench (and, through LocalFleet's finally, its fleet) after ``seconds``."""

    def fire(*_: object) -> None:
        raise TimeoutError(f"bench deadline of {seconds:.0f} s passed")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(int(seconds))


def make_vllm_model(out: Path, positions: int) -> Path:
    """tests/vllm's tiny model, its window raised to ``positions`` tokens."""
    assert make_model(["--out", str(out), "--preset", "tiny-vllm", "--seed", "5"]) == 0
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max(positions, int(config["max_position_embeddings"]))
    config_path.write_text(json.dumps(config, indent=2))
    return out


def engine_args(max_model_len: int, kv_cache_gib: int = 1) -> str:
    return (
        f'dtype = "float32"\nmax_model_len = {max_model_len}\n'
        f"kv_cache_gib = {kv_cache_gib}\nenforce_eager = true\n"
    )


def vllm_fleet(
    root: Path, model: Path, nodes: tuple[NodeSpec, ...], max_model_len: int
) -> LocalFleet:
    """A daemon and one agent per node; two vLLM models of the same weights and engine
    arguments, one with the disk KV connector (``KV_MODEL``), one without (``RC_MODEL``)."""
    args = engine_args(max_model_len)
    kv = f'kv_connector = "FleetShiftDiskConnector"\nkv_connector_path = "{root / KV_STORE}"\n'
    models = "".join(
        f'[[models]]\nname = "{name}"\nhf_config = "{model}"\nmodel_dir = "{model}"\n'
        f'tp_options = [1]\nengine = "vllm"\n[models.engine_args]\n{extra}'
        for name, extra in ((KV_MODEL, args + kv), (RC_MODEL, args))
    )
    return LocalFleet(
        root,
        nodes,
        heartbeat_interval_s=0.5,
        node_lost_after_s=30.0,
        metrics=True,
        daemon_extra="[planner]\ninterval_s = 0\n" + models,
        agent_extra=(
            f'worker_threads = 1\nworker_start_timeout_s = 580\nvllm_python = "{vllm_python()}"\n'
        ),
    )


async def start_worker(ops: pb_grpc.OperationsStub, node: str, model: str) -> fpb.WorkerStatus:
    return await ops.StartWorker(
        pb.StartFleetWorkerRequest(model=model, role=fpb.WORKER_ROLE_MIXED, node_name=node),
        timeout=600,
    )


async def move(
    ops: pb_grpc.OperationsStub, worker_id: str, target: str, timeout_s: float = 900
) -> tuple[pb.Operation, dict[str, float], float]:
    """MoveWorker and watch it: the operation, when each phase was first seen (seconds from
    the call) and the total."""
    t0 = time.perf_counter()
    op = await ops.MoveWorker(
        pb.MoveWorkerRequest(worker_id=worker_id, target_node=target, reason="bench"), timeout=30
    )
    phases: dict[str, float] = {}
    async for update in ops.WatchOperation(
        pb.WatchOperationRequest(operation_id=op.id), timeout=timeout_s
    ):
        op = update
        if op.steps:
            phases.setdefault(op.steps[0].phase, time.perf_counter() - t0)
    return op, phases, time.perf_counter() - t0


def machine_load() -> str:
    up = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return f"{up} ({os.cpu_count()} cores)"


# The worker's ready line: "ready on port N (plaintext) in S s (vLLM V on 127.0.0.1:M, pid P)"
# (the security in parentheses since mTLS; older lines lack it and say "on port M").
READY = re.compile(
    r"ready on port (\d+)(?: \(\w+\))? in ([\d.]+) s \(vLLM .* on (?:port |127\.0\.0\.1:)(\d+)"
)


@dataclass
class WorkerProcess:
    """A vLLM worker started as the agent starts it (``python -m fleetshift_agent.vllm_worker``)
    but without an agent or a daemon: its gRPC port, its vLLM server's port, its start time."""

    proc: subprocess.Popen[bytes]
    grpc_port: int
    vllm_port: int
    ready_s: float

    def stop(self) -> None:
        stop_worker(self.proc)


def stop_worker(proc: Popen[bytes]) -> None:
    """End a worker's process group (its vLLM server with it): SIGTERM, SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def spawn_worker(
    model: Path,
    logs: Path,
    name: str,
    engine: dict[str, object],
    src: str = "",
    nice: int = 0,
) -> Popen[bytes]:
    """A vLLM worker as the agent starts it; with ``src``, its FleetShift code (the shim)
    comes from that source tree (``git archive BASE agent common proto | tar -x -C src``), so
    a bench can run a change's before and after side by side. ``nice``: the worker and its
    vLLM server run that much below the bench, so a client that would run on another host
    in production is not starved by them on a shared 2-core machine."""
    env = None
    if src:
        root = Path(src).resolve()
        paths = [str(root / d) for d in ("agent", "common", "proto")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    argv = [
        sys.executable, "-m", "fleetshift_agent.vllm_worker",
        "--model-dir", str(model), "--model-id", "vllm-bench",
        "--engine-args", json.dumps(engine), "--vllm-python", vllm_python(), "--threads", "1",
        "--worker-id", name, "--declared-gpu", "NVIDIA H100 80GB HBM3",
        "--start-timeout-s", "580",
    ]  # fmt: skip
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip


def wait_worker(proc: Popen[bytes], logs: Path, name: str, timeout_s: float = 620) -> WorkerProcess:
    """Block until the worker serves (its log says so); exit naming its log if it does not."""
    path = logs / f"{name}.log"
    ends = time.monotonic() + timeout_s
    while time.monotonic() < ends:
        found = READY.search(path.read_text(errors="replace"))
        if found:
            ready = float(found.group(2))
            return WorkerProcess(proc, int(found.group(1)), int(found.group(3)), ready)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(f"vLLM worker {name} did not start:\n{path.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def serving_worker(
    model: Path, logs: Path, name: str, engine: dict[str, object], **spawn: Any
) -> Iterator[WorkerProcess]:
    """One worker (``spawn_worker``'s ``src``/``nice`` pass through), once it serves; stopped
    on the way out, whatever happened."""
    proc = spawn_worker(model, logs, name, engine, **spawn)
    try:
        yield wait_worker(proc, logs, name)
    finally:
        stop_worker(proc)
