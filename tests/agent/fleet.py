"""Agents (in this process or as their own process) with real workers, for the agent tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_agent.app import Agent
from fleetshift_common.config import AgentConfig, DeclaredGpu
from fleetshift_rpc.server import ServiceBinding, start_server

REPO = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
T = TypeVar("T")


def agent_config(
    daemon_port: int, name: str, state_dir: Path, product: str = H100, gpus: int = 2
) -> AgentConfig:
    return AgentConfig(
        node_name=name,
        listen="127.0.0.1:0",
        daemon_address=f"127.0.0.1:{daemon_port}",
        state_dir=str(state_dir),
        inventory="declared",
        gpus=(DeclaredGpu(product, gpus),),
        reconnect_initial_s=0.05,
        reconnect_max_s=0.5,
        worker_compile=False,
        worker_threads=1,
        worker_start_timeout_s=120.0,
    )


@contextlib.asynccontextmanager
async def running_agent(config: AgentConfig) -> AsyncIterator[Agent]:
    """An agent in this process; its workers are stopped (SIGKILL) when the test ends."""
    agent = Agent(config)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop(0.1)
        kill_workers(Path(config.state_dir))


@contextlib.asynccontextmanager
async def serving_registry(
    servicer: pb_grpc.AgentRegistryServicer, port: int = 0
) -> AsyncIterator[int]:
    """Serve a test's own AgentRegistry on a real gRPC port (a free one unless given), so an
    agent under test heartbeats to something that records or holds its reports; yields the
    port."""
    name = pb.DESCRIPTOR.services_by_name["AgentRegistry"].full_name
    binding = ServiceBinding(pb_grpc.add_AgentRegistryServicer_to_server, servicer, name)
    server = await start_server(f"127.0.0.1:{port}", [binding], 4 << 20, None, ())
    try:
        yield server.port
    finally:
        await server.server.stop(0)


def kill_workers(state_dir: Path) -> None:
    """SIGKILL every worker process group an agent with this state directory recorded."""
    for record in (state_dir / "workers").glob("*.json"):
        pid = json.loads(record.read_text())["pid"]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def worker_pid(state_dir: Path, worker_id: str) -> int:
    return int(json.loads((state_dir / "workers" / f"{worker_id}.json").read_text())["pid"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def agent_stub(ch: grpc.aio.Channel) -> agent_pb2_grpc.AgentServiceStub:
    return agent_pb2_grpc.AgentServiceStub(ch)


def worker_stub(ch: grpc.aio.Channel) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(ch)


def start_request(
    worker_id: str,
    model_dir: Path | None = None,
    gpus: tuple[int, ...] = (0,),
    snapshot_id: str = "",
) -> agent_pb2.StartWorkerRequest:
    return agent_pb2.StartWorkerRequest(
        worker_id=worker_id,
        model="tiny",
        model_dir=str(model_dir or ""),
        role=pb.WORKER_ROLE_MIXED,
        dtype="bf16",
        gpu_indices=list(gpus),
        restore_snapshot_id=snapshot_id,
    )


async def worker_info(endpoint: str) -> worker_pb2.WorkerInfo:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return await worker_stub(ch).GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)


async def eventually(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout_s: float = 20.0
) -> T:
    """Probe until ``ok`` holds (real processes settle at their own pace); returns the value."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = await probe()
            if ok(value):
                return value
        except grpc.aio.AioRpcError:
            value = None  # type: ignore[assignment]
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout_s} s; last value: {value}")
        await asyncio.sleep(0.1)


class AgentProcess:
    """``python -m fleetshift_agent.main`` with a TOML config, as systemd would run it."""

    def __init__(self, config: AgentConfig, root: Path) -> None:
        self.config = config
        self.root = root
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _toml(self, port_file: Path) -> str:
        c = self.config
        gpu = c.gpus[0]
        return (
            f'node_name = "{c.node_name}"\nlisten = "{c.listen}"\n'
            f'daemon_address = "{c.daemon_address}"\nstate_dir = "{c.state_dir}"\n'
            f'inventory = "declared"\nport_file = "{port_file}"\n'
            f"reconnect_initial_s = {c.reconnect_initial_s}\n"
            f"reconnect_max_s = {c.reconnect_max_s}\n"
            f"worker_compile = {str(c.worker_compile).lower()}\n"
            f"worker_threads = {c.worker_threads}\n"
            f'[[gpus]]\nproduct_name = "{gpu.product_name}"\ncount = {gpu.count}\n'
        )

    async def start(self, timeout_s: float = 60.0) -> None:
        port_file = self.root / f"{self.config.node_name}.port"
        port_file.unlink(missing_ok=True)
        config = self.root / f"{self.config.node_name}.toml"
        config.write_text(self._toml(port_file))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with (self.root / f"{self.config.node_name}.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleetshift_agent.main", "--config", str(config)],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent did not start (exit {self.proc.returncode})")
            await asyncio.sleep(0.05)
        self.port = int(port_file.read_text())

    async def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        while self.proc.poll() is None:  # without blocking the daemon in this event loop
            await asyncio.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        kill_workers(Path(self.config.state_dir))


async def paused_session(
    worker: worker_pb2_grpc.WorkerServiceStub, session_id: str, tokens: int, steps: int
) -> tuple[object, list[worker_pb2.GenerateResponse]]:
    """A session that ran exactly ``steps`` engine steps on a now paused worker.

    Returns its open stream and the tokens read from it so far; the worker stays paused
    until the test resumes it, however fast the engine is.
    """
    await worker.Pause(worker_pb2.WorkerPauseRequest())
    stream = worker.Generate(
        worker_pb2.GenerateRequest(
            prompt_tokens=[5, 6, 7, 8], max_new_tokens=tokens, session_id=session_id
        )
    )
    await eventually(
        lambda: worker.GetCounters(worker_pb2.GetWorkerCountersRequest()),
        lambda c: c.live_sessions == 1,
    )
    await worker.Resume(worker_pb2.WorkerResumeRequest(steps=steps))
    received = [await stream.read() for _ in range(steps)]
    return stream, received
