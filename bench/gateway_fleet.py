"""The fleet both gateway benches measure against: a daemon, one agent declaring an H100, one
reference-engine worker (``--threads 1``, no compile) of a locally made model, and gateway
processes in front of it, the current code and optionally a baseline source tree's."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
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
    token: str = ""  # non-empty: every gateway requires it as a bearer token

    def auth(self) -> dict[str, str]:
        """The headers a client sends to these gateways."""
        return {"authorization": f"Bearer {self.token}"} if self.token else {}


def baseline_env(src: Path, root: Path) -> dict[str, str]:
    """Run a gateway from another source tree (``git archive`` of an earlier commit): its
    gateway, common and proto packages first on the path. A tree from before httptools was a
    dependency (its gateway does not name it) runs with httptools hidden, so uvicorn falls
    back to h11 as it did then; a later one (it picks httptools itself) runs as it is."""
    paths = [src / "gateway", src / "common", src / "proto"]
    if "httptools" not in (src / "gateway" / "fleetshift_gateway" / "main.py").read_text():
        shim = root / "no-httptools" / "httptools"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "__init__.py").write_text("raise ImportError('hidden for the baseline gateway')\n")
        paths.append(shim.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


@contextmanager
def bench_fleet(
    preset: str,
    *,
    baseline_src: Path | None = None,
    profile: Path | None = None,
    pin_gateway: str = "",
    variants: dict[str, tuple[str, ...]] | None = None,
    token: str = "",
) -> Iterator[BenchFleet]:
    """The fleet, its worker started, and gateway ``current`` (and ``baseline``) listening.
    ``pin_gateway`` runs the gateways under ``taskset -c CPUS``; ``variants`` adds gateways of
    the current code run with other options (name: its extra command-line arguments)."""
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
        bench = BenchFleet(fleet, model_dir, "", token=token)
        prefix = ["taskset", "-c", pin_gateway] if pin_gateway else []
        auth: tuple[str, ...] = ()
        if token:
            (root / "token").write_text(token)
            auth = ("--token-file", str(root / "token"))
        try:
            fleet.start(timeout_s=120)
            bench.worker = asyncio.run(_start_worker(fleet.daemon_address))
            daemon = fleet.daemon_address
            opts = ["-m", "cProfile", "-o", str(profile)] if profile else []
            bench.gateways["current"] = start_gateway(
                root / "gw", daemon, MODEL, model_dir, *auth, prefix=prefix, python_opts=opts
            )
            for name, extra in (variants or {}).items():
                bench.gateways[name] = start_gateway(
                    root / f"gw-{name}", daemon, MODEL, model_dir, *extra, *auth, prefix=prefix
                )
            if baseline_src is not None:
                env = baseline_env(baseline_src, root)
                bench.gateways["baseline"] = start_gateway(
                    root / "gw-base", daemon, MODEL, model_dir, *auth, prefix=prefix, env=env
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


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both benches take for their fleet and gateways."""
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also measure a gateway run from this source tree (e.g. `git archive` of main)",
    )
    parser.add_argument(
        "--profile-gateway", type=Path, help="run the current gateway under cProfile, stats here"
    )
    parser.add_argument(
        "--no-cache-variant",
        action="store_true",
        help="also measure the current gateway with --route-cache-s 0 (every request waits "
        "for its own Route call)",
    )
    parser.add_argument(
        "--token",
        action="store_true",
        help="every gateway requires a bearer token (--token-file) and every client sends it",
    )


def fleet_for(
    args: argparse.Namespace, pin_gateway: str = ""
) -> AbstractContextManager[BenchFleet]:
    """``bench_fleet`` as the options of ``add_fleet_arguments`` ask for it."""
    return bench_fleet(
        args.preset,
        baseline_src=args.baseline_src,
        profile=args.profile_gateway,
        pin_gateway=pin_gateway,
        variants={"no kept routes": ("--route-cache-s", "0")} if args.no_cache_variant else None,
        token="bench-token" if args.token else "",
    )


def bench_prompt(tokens: int) -> list[int]:
    """The same prompt in every bench and round: token ids the tiny vocabulary holds."""
    return [(7 * i) % 200 + 1 for i in range(tokens)]


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit("a helper of bench/gateway_overhead.py and bench/gateway_rps.py")
