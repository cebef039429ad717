"""Starting real worker processes for tests, and talking to them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_agent.engine import SamplingParams

from .helpers import DEVICE, Request

REPO = Path(__file__).resolve().parents[2]


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.aio.Channel:
        opts = [("grpc.max_receive_message_length", 256 << 20)]
        return grpc.aio.insecure_channel(self.address, options=opts)

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@dataclass
class Workers:
    root: Path
    started: list[WorkerProcess] = field(default_factory=list)

    def start(self, *args: str, timeout: float = 60.0) -> WorkerProcess:
        n = len(self.started)
        port_file = self.root / f"worker-{n}.port"
        log = self.root / f"worker-{n}.log"
        cmd = [
            sys.executable, "-m", "fleetshift_agent.worker",
            "--port-file", str(port_file), "--threads", "1", "--no-compile",
            "--worker-id", f"test-{n}", "--device", DEVICE, *args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"worker did not start:\n{log.read_text()}")
            time.sleep(0.05)
        worker = WorkerProcess(proc, int(port_file.read_text()), log)
        self.started.append(worker)
        return worker

    def stop_all(self) -> None:
        for w in self.started:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(timeout=10)


def workers_in(root: Path) -> Iterator[Workers]:
    workers = Workers(root)
    try:
        yield workers
    finally:
        workers.stop_all()


def sampling(params: SamplingParams) -> worker_pb2.WorkerSampling:
    return worker_pb2.WorkerSampling(
        temperature=params.temperature, top_p=params.top_p, seed=params.seed
    )


def generate_request(sid: str, request: Request) -> worker_pb2.GenerateRequest:
    prompt, max_new, params = request
    return worker_pb2.GenerateRequest(
        session_id=sid, prompt_tokens=prompt, max_new_tokens=max_new, sampling=sampling(params)
    )


def stub(channel: grpc.aio.Channel) -> worker_pb2_grpc.WorkerServiceStub:
    return worker_pb2_grpc.WorkerServiceStub(channel)


async def resume(s: worker_pb2_grpc.WorkerServiceStub, sid: str, have: list[int]) -> list[int]:
    """Attaches to a session and returns every token after those the client already has."""
    out: list[int] = []
    req = worker_pb2.GenerateRequest(resume_session_id=sid, resume_from_token=len(have))
    async for msg in s.Generate(req):
        assert msg.index == len(have) + len(out)
        out.append(msg.token)
    return out
