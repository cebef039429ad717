"""An agent process that restarts (SIGKILL or SIGTERM) leaves its workers serving and adopts them.

The agent runs as its own process, exactly as systemd starts it; the daemon runs in this
process. A client streams tokens from the worker across the agent's death and restart.
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2, placement_pb2, placement_pb2_grpc, worker_pb2
from fleetshift.v1 import fleet_pb2 as pb

from .fleet import (
    AgentProcess,
    agent_config,
    agent_stub,
    alive,
    eventually,
    paused_session,
    start_request,
    worker_pid,
    worker_stub,
)

pytestmark = pytest.mark.slow
TOKENS = 40


async def _daemon_worker(daemon_port: int, worker_id: str) -> pb.WorkerStatus | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon_port}") as ch:
        reply = await placement_pb2_grpc.PlanningStub(ch).ListWorkers(
            placement_pb2.ListWorkersRequest(), timeout=5
        )
    return next((w for w in reply.workers if w.worker_id == worker_id), None)


async def _agent_info(address: str) -> agent_pb2.AgentInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await agent_stub(ch).GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=5)


async def _counters(endpoint: str) -> pb.WorkerCounters:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return await worker_stub(ch).GetCounters(worker_pb2.GetWorkerCountersRequest())


async def test_workers_survive_agent_restarts_and_are_adopted(
    daemon: object, tiny_model: Path, tmp_path: Path
) -> None:
    port = daemon.port  # type: ignore[attr-defined]
    state = tmp_path / "state"
    agent = AgentProcess(agent_config(port, "h100-a", state), tmp_path)
    try:
        await agent.start()
        async with grpc.aio.insecure_channel(agent.address) as ch:
            started = await agent_stub(ch).StartWorker(
                start_request("w-keep", tiny_model), timeout=120
            )
        assert started.state == pb.WORKER_STATE_SERVING and started.endpoint
        pid = worker_pid(state, "w-keep")

        async with grpc.aio.insecure_channel(started.endpoint) as wch:
            worker = worker_stub(wch)
            stream, received = await paused_session(worker, "chat-1", TOKENS, steps=3)
            before = await _counters(started.endpoint)

            await agent.signal(signal.SIGKILL)
            assert alive(pid), "the worker died with its agent"
            await agent.start()
            info = await eventually(
                lambda: _agent_info(agent.address),
                lambda i: i.registered and [w.worker_id for w in i.workers] == ["w-keep"],
            )
            adopted = info.workers[0]
            assert worker_pid(state, "w-keep") == pid
            assert adopted.endpoint == started.endpoint
            assert adopted.state == pb.WORKER_STATE_SERVING
            assert list(adopted.gpu_indices) == [0] and adopted.model == "tiny"

            await worker.Resume(worker_pb2.WorkerResumeRequest())
            while not received[-1].finished:  # the same stream, never broken
                received.append(await stream.read())  # type: ignore[attr-defined]

        assert [m.index for m in received] == list(range(TOKENS))
        assert received[-1].finished and all(m.session_id == "chat-1" for m in received)
        after = await _counters(started.endpoint)
        assert after.decode_tokens > before.decode_tokens
        # Only the new agent saw these counters: the daemon hears them through its heartbeats.
        reported = await eventually(
            lambda: _daemon_worker(port, "w-keep"),
            lambda w: w is not None and w.counters.decode_tokens == after.decode_tokens,
        )
        assert reported is not None and reported.state == pb.WORKER_STATE_SERVING
        assert list(reported.session_ids) == []

        # A graceful stop (SIGTERM, as systemd stops the unit) leaves the worker serving too.
        await agent.signal(signal.SIGTERM)
        assert agent.proc is not None and agent.proc.returncode == 0
        assert alive(pid)
        await agent.start()
        async with grpc.aio.insecure_channel(agent.address) as ch:
            stopped = await agent_stub(ch).StopWorker(
                agent_pb2.StopWorkerRequest(worker_id="w-keep", grace_s=5), timeout=30
            )
        assert stopped.state == pb.WORKER_STATE_STOPPED
        await eventually(lambda: _none(), lambda _: not alive(pid), timeout_s=10)
        gone = await eventually(
            lambda: _daemon_worker(port, "w-keep"),
            lambda w: w is not None and w.state == pb.WORKER_STATE_STOPPED,
        )
        assert gone is not None
        await eventually(lambda: _agent_info(agent.address), lambda i: list(i.workers) == [])
        assert list((state / "workers").glob("*.json")) == []
    finally:
        agent.kill()


async def _none() -> None:
    return None


async def test_a_start_cut_short_by_an_agent_crash_leaves_no_worker_behind(
    daemon: object, tiny_model: Path, tmp_path: Path
) -> None:
    """The daemon saw that StartWorker fail: the restarted agent stops the half-born worker."""
    port = daemon.port  # type: ignore[attr-defined]
    state = tmp_path / "state"
    agent = AgentProcess(agent_config(port, "h100-b", state), tmp_path)
    try:
        await agent.start()
        async with grpc.aio.insecure_channel(agent.address) as ch:
            call = agent_stub(ch).StartWorker(start_request("w-half", tiny_model), timeout=120)
            record = state / "workers" / "w-half.json"
            await eventually(_none, lambda _: record.exists(), timeout_s=30)
            pid = worker_pid(state, "w-half")
            await agent.signal(signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert alive(pid)
        await agent.start()
        await eventually(_none, lambda _: not alive(pid), timeout_s=15)
        info = await eventually(lambda: _agent_info(agent.address), lambda i: i.registered)
        assert list(info.workers) == [] and not record.exists()
    finally:
        agent.kill()
