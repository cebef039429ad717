"""What the tests that run a real fleet share (tests/e2e, tests/replicas, tests/multihost):
the sessions they stream, the token streams an unmoved run produces, an operation's end, and
whether the registry says what the agents run. Imports no torch: the multihost client runs it
in a namespace of its own, where importing torch costs tens of seconds on a loaded machine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc

Session = tuple[str, list[int], float, int | None]
# Two greedy and two seeded sessions, long enough to be mid-stream while a move runs.
SESSIONS: list[Session] = [
    ("s-greedy-1", [11, 22, 33, 44], 0.0, None),
    ("s-greedy-2", [5, 6, 7, 8, 9, 10], 0.0, None),
    ("s-seeded-1", [100, 200, 300], 0.9, 1234),
    ("s-seeded-2", [42] * 12, 1.2, 99),
]


def request(session: Session, tokens: int, suffix: str = "") -> worker_pb2.GenerateRequest:
    sid, prompt, temperature, seed = session
    sampling = worker_pb2.WorkerSampling(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
        sampling.top_p = 0.9
    return worker_pb2.GenerateRequest(
        prompt_tokens=prompt, max_new_tokens=tokens, sampling=sampling, session_id=sid + suffix
    )


def reference_streams(
    model_dir: Path,
    port_file: Path,
    model: str,
    lengths: Iterable[int],
    graceful: bool = True,
) -> dict[int, dict[str, list[int]]]:
    """Per session length, what each of SESSIONS produces on a worker nothing moves.

    ``graceful`` stops the worker with SIGTERM first (e2e); otherwise it is killed at once, its output being all in
    (replicas: no need to wait for a graceful stop on a busy host)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetshift_agent.worker", "--model-dir", str(model_dir),
         "--listen", "127.0.0.1:0", "--port-file", str(port_file), "--no-compile", "--threads", "1",
         "--model-id", model],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        endpoint = f"127.0.0.1:{int(port_file.read_text())}"

        async def run(tokens: int) -> dict[str, list[int]]:
            async with grpc.aio.insecure_channel(endpoint) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)

                async def one(s: Session) -> list[int]:
                    return [m.token async for m in stub.Generate(request(s, tokens, "-ref"))]

                results = await asyncio.gather(*(one(s) for s in SESSIONS))
            return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}

        return {n: asyncio.run(run(n)) for n in lengths}
    finally:
        if graceful:
            proc.terminate()
            try:
                proc.wait(timeout=30)  # a loaded machine may take a while to let it exit
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        else:
            proc.kill()
            proc.wait(timeout=60)


async def finished(ops: pb_grpc.OperationsStub, op_id: str, timeout_s: float = 240) -> pb.Operation:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            op = await ops.GetOperation(pb.GetOperationRequest(operation_id=op_id), timeout=5)
            if op.state in (pb.OPERATION_STATE_SUCCEEDED, pb.OPERATION_STATE_FAILED):
                return op
        except grpc.aio.AioRpcError:
            pass  # the daemon is restarting
        assert time.monotonic() < deadline, "operation did not finish"
        await asyncio.sleep(0.2)


async def serving(daemon: grpc.aio.Channel) -> dict[str, fpb.WorkerStatus]:
    listed = await ppb_grpc.PlanningStub(daemon).ListWorkers(ppb.ListWorkersRequest(), timeout=10)
    return {w.worker_id: w for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING}


async def registry_matches_agents(daemon: grpc.aio.Channel) -> set[str]:
    """The serving workers in the registry are exactly those running on the agents."""
    deadline = time.monotonic() + 30
    while True:
        registry = set(await serving(daemon))
        nodes = await fpb_grpc.FleetOperatorStub(daemon).ListNodes(fpb.ListNodesRequest())
        running: set[str] = set()
        for node in nodes.nodes:
            async with grpc.aio.insecure_channel(node.agent_address) as ch:
                info = await agent_pb2_grpc.AgentServiceStub(ch).GetAgentInfo(
                    agent_pb2.GetAgentInfoRequest(), timeout=5
                )
            running |= {w.worker_id for w in info.workers if w.state == fpb.WORKER_STATE_SERVING}
        if registry == running or time.monotonic() > deadline:
            assert registry == running
            return registry
        await asyncio.sleep(0.3)
