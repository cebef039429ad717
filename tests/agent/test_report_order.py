"""The daemon never hears a worker's old state after the agent answered its start or stop.

A heartbeat is built from the agent's view of its workers and then sent; if a stop finished in
between and its answer overtook the heartbeat, the daemon would record the worker stopped and
then serving again (and route to it). The agent read-holds its report lock from building a
heartbeat until the daemon answers it, and write-holds it for the last step of a start or stop.

The race is provoked, not waited for: the registry holds a heartbeat that says w0 serves, and a
failpoint holds the stop right after the worker process is gone and before the daemon is told
(``agent:stop:stopped``). The test checks that moment is reached (the worker dead, the stale
report in flight) before it lets both go on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2
from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.failpoints import ENV, Failpoints

from .fleet import (
    agent_config,
    agent_stub,
    alive,
    running_agent,
    serving_registry,
    start_request,
    worker_pid,
)

pytestmark = pytest.mark.slow


class HoldingRegistry(pb_grpc.AgentRegistryServicer):
    """Plays the daemon's agent registry: notes what each answered heartbeat said, in order,
    and can hold a heartbeat unanswered until released."""

    def __init__(self) -> None:
        self.answered: list[tuple[float, dict[str, int]]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.holding = asyncio.Event()

    async def RegisterNode(self, request, context):  # type: ignore[no-untyped-def]
        return pb.RegisterNodeResponse(
            node=pb.Node(name=request.node_name), heartbeat_interval_ms=100, created=True
        )

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        states = {w.worker_id: w.state for w in request.workers}
        if not self.release.is_set():
            self.holding.set()
            await self.release.wait()
        self.answered.append((time.monotonic(), states))
        return pb.HeartbeatResponse(state=pb.NODE_STATE_READY)


@pytest.fixture
async def registry() -> AsyncIterator[tuple[HoldingRegistry, int]]:
    servicer = HoldingRegistry()
    async with serving_registry(servicer) as port:
        yield servicer, port


async def test_a_heartbeat_built_before_a_stop_is_answered_before_the_stop(
    registry: tuple[HoldingRegistry, int], tiny_model: Path, tmp_path: Path
) -> None:
    daemon, port = registry
    async with (
        running_agent(agent_config(port, "h100-x", tmp_path / "state")) as agent,
        grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch,
    ):
        stub = agent_stub(ch)
        await stub.StartWorker(start_request("w0", tiny_model), timeout=120)
        serving = pb.WORKER_STATE_SERVING
        while not any(states.get("w0") == serving for _, states in daemon.answered):
            await asyncio.sleep(0.05)

        pid = worker_pid(tmp_path / "state", "w0")
        marker = tmp_path / "stop-held"
        assert agent.supervisor is not None
        agent.supervisor.failpoints = Failpoints({ENV: f"agent:stop:stopped=hold:{marker}"})
        daemon.release.clear()
        await asyncio.wait_for(daemon.holding.wait(), 10)  # a report of w0 serving, in flight
        stop = asyncio.ensure_future(
            stub.StopWorker(agent_pb2.StopWorkerRequest(worker_id="w0"), timeout=60)
        )
        while not marker.exists():  # the stop reaches the failpoint
            assert not stop.done(), stop
            await asyncio.sleep(0.02)
        # The race: the worker is gone, the report that says it serves is still unanswered.
        assert not alive(pid)
        assert agent.supervisor.reporting.reader.locked  # the report, in flight
        assert daemon.holding.is_set() and not daemon.release.is_set()
        marker.unlink()
        released_at = time.monotonic()
        daemon.release.set()
        stopped = await stop
        stopped_at = time.monotonic()
        while not any(at > stopped_at for at, _ in daemon.answered):
            await asyncio.sleep(0.05)

    assert stopped.state == pb.WORKER_STATE_STOPPED
    held = [states for at, states in daemon.answered if at >= released_at]
    assert held[0].get("w0") == serving  # the report built before the stop ...
    answered_after_stop = [states for at, states in daemon.answered if at > stopped_at]
    # ... was answered before the stop was, and nothing after it says w0 serves.
    assert all(states.get("w0") != serving for states in answered_after_stop)
    assert [at for at, states in daemon.answered if states.get("w0") == serving][-1] < stopped_at
