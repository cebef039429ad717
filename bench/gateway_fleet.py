"""The fleet both gateway benches measure against: a daemon, one agent declaring an H100, one
reference-engine worker (``--threads 1``, no compile) of a locally made model, and gateway
processes in front of it, the current code and optionally a baseline source tree's."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from tests.gateway.procs import GatewayProcess, start_gateway, stop

MODEL = "bench-model"


@dataclass
class BenchFleet:
    fleet: LocalFleet
    model_dir: Path
    worker: str  # the worker's endpoint, for the direct baseline
    gateways: dict[str, GatewayProcess] = field(default_factory=dict)


def baseline_env(src: Path, root: Path) -> dict[str, str]:
    """Run a gateway from another source tree (``git archive`` of an earlier commit): its
    gateway, common and proto packages first on the path, and httptools hidden, so uvicorn
    falls back to h11 as it did before httptools was a dependency."""
    shim = root / "no-httptools" / "httptools"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text("raise ImportError('hidden for the baseline gateway')\n")
    paths = [src / "gateway", src / "common", src / "proto", shim.parent]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


@contextmanager
def bench_fleet(
    preset: str,
    *,
    baseline_src: Path | None = None,
    profile: Path | None = None,
    pin_gateway: str = "",
) -> Iterator[BenchFleet]:
    """The fleet, its worker started, and gateway ``current`` (and ``baseline``) listening.
    ``pin_gateway`` runs the gateways under ``taskset -c CPUS``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = root / "model"
        assert make_model(["--out", str(model_dir), "--preset", preset]) == 0
        fleet = LocalFleet(
            root / "fleet",
            (NodeSpec("n1", "NVIDIA H100 80GB HBM3", 1),),
            heartbeat_interval_s=0.5,
            daemon_extra=(
                "[planner]\ninterval_s = 0\n"
                f'[[models]]\nname = "{MODEL}"\nhf_config = "{model_dir}"\n'
                f'model_dir = "{model_dir}"\ntp_options = [1]\n'
            ),
            agent_extra="worker_compile = false\nworker_threads = 1\n",
        )
        bench = BenchFleet(fleet, model_dir, "")
        prefix = ["taskset", "-c", pin_gateway] if pin_gateway else []
        try:
            fleet.start(timeout_s=120)
            bench.worker = asyncio.run(_start_worker(fleet.daemon_address))
            daemon = fleet.daemon_address
            opts = ["-m", "cProfile", "-o", str(profile)] if profile else []
            bench.gateways["current"] = start_gateway(
                root / "gw", daemon, MODEL, model_dir, prefix=prefix, python_opts=opts
            )
            if baseline_src is not None:
                env = baseline_env(baseline_src, root)
                bench.gateways["baseline"] = start_gateway(
                    root / "gw-base", daemon, MODEL, model_dir, prefix=prefix, env=env
                )
            yield bench
        finally:
            for gw in bench.gateways.values():
                stop(gw, signal.SIGINT)  # SIGINT: a gateway under cProfile writes its stats
            fleet.stop()


async def _start_worker(daemon: str) -> str:
    async with grpc.aio.insecure_channel(daemon) as ch:
        worker = await pb_grpc.OperationsStub(ch).StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name="n1"),
            timeout=300,
        )
    return str(worker.endpoint)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit("a helper of bench/gateway_overhead.py and bench/gateway_rps.py")
