"""vLLM workers behind FleetShift, with real processes: a daemon, agents, vLLM servers.

What a user sees: the daemon starts a vLLM worker through an agent, Route answers it, a
session streams exactly vLLM's own greedy tokens and re-attaches at a token index, vLLM's
counters reach the daemon and move the traffic mix, its finished sessions teach the daemon's
output-length estimator, and a bad engine argument fails the
start naming vLLM's reason while the agent serves on with nothing half-registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import follow_session
from tests.vllm.conftest import BAD_MODEL, MODEL, SESSIONS, request, vllm_alone

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TOKENS = 48
T = TypeVar("T")


async def start_worker(
    ops: pb_grpc.OperationsStub, node: str, model: str = MODEL
) -> fpb.WorkerStatus:
    return await ops.StartWorker(
        pb.StartFleetWorkerRequest(model=model, role=fpb.WORKER_ROLE_MIXED, node_name=node),
        timeout=600,
    )


@contextlib.asynccontextmanager
async def worker_pair(
    fleet: LocalFleet, model: str
) -> AsyncIterator[tuple[worker_pb2_grpc.WorkerServiceStub, worker_pb2_grpc.WorkerServiceStub]]:
    """Two workers of ``model`` started through the daemon, on cpu-a (the source) and cpu-b:
    their WorkerService stubs, for tests that move sessions worker to worker as the executor
    does."""
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        src = await start_worker(ops, "cpu-a", model)
        dst = await start_worker(ops, "cpu-b", model)
    async with (
        grpc.aio.insecure_channel(src.endpoint) as a_ch,
        grpc.aio.insecure_channel(dst.endpoint) as b_ch,
    ):
        yield worker_pb2_grpc.WorkerServiceStub(a_ch), worker_pb2_grpc.WorkerServiceStub(b_ch)


async def listed(daemon: grpc.aio.Channel) -> list[fpb.WorkerStatus]:
    reply = await ppb_grpc.PlanningStub(daemon).ListWorkers(ppb.ListWorkersRequest())
    return list(reply.workers)


def agent_address(fleet: LocalFleet, node: str) -> str:
    return f"127.0.0.1:{int((fleet.state_dir / f'agent-{node}.port').read_text())}"


async def wait_for(probe: Callable[[], Awaitable[T | None]], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await probe()
        if found is not None:
            return found
        await asyncio.sleep(0.25)
    raise AssertionError(f"{what} within {timeout_s} s")


async def test_vllm_worker_serves_routes_streams_and_reports(
    fleet: LocalFleet, vllm_python: str, vllm_model: Path, tmp_path: Path
) -> None:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        placement = ppb_grpc.PlacementStub(daemon)
        worker = await start_worker(ops, "cpu-a")
        assert worker.state == fpb.WORKER_STATE_SERVING and worker.endpoint

        # One routed request with a prefill-heavy estimate: the mix starts from the requests.
        routed = await placement.Route(
            ppb.RouteRequest(model=MODEL, prompt_tokens=500, expected_output_tokens=1), timeout=10
        )
        assert routed.endpoint == worker.endpoint  # the model's only worker, a vLLM one

        async def one(sid: str, prompt: list[int]) -> list[int]:
            stream = follow_session(daemon, routed.endpoint, request(sid, prompt, TOKENS))
            return [m.token async for m in stream]

        results = await asyncio.gather(*(one(*s) for s in SESSIONS))
        served = {sid: tokens for (sid, _), tokens in zip(SESSIONS, results, strict=True)}
        assert all(len(t) == TOKENS for t in served.values())

        async with grpc.aio.insecure_channel(worker.endpoint) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            info = await stub.GetInfo(worker_pb2.GetWorkerInfoRequest())
            assert (info.compat_key.engine_name, info.model_id) == ("vllm", MODEL)
            assert info.compat_key.engine_version
            # A client that lost its stream re-attaches at the index it had reached.
            first = []
            # Held after 12 tokens (hold_after_tokens), so the cancel below always finds it
            # live: 48 tokens could otherwise all be made before a slow client's cancel lands,
            # and a probe that finished by its length would count as a finished session.
            live = stub.Generate(request("reattach", SESSIONS[0][1], TOKENS, hold=12))
            async for msg in live:
                first.append(msg.token)
                if msg.index == 9:
                    break
            live.cancel()
            # (cancelling the stream of a live session ends it, as with the reference worker;
            # re-attaching needs a session that outlives its client: an imported one)
            exported = None
            # Held after 12 too: without it a client slower than vLLM can find the session
            # ended by its length before the export below (a CI run did).
            second = stub.Generate(request("carried", SESSIONS[0][1], TOKENS, hold=12))
            async for msg in second:
                if msg.index == 9:
                    exported = await stub.ExportSession(
                        worker_pb2.ExportSessionRequest(session_id="carried", release=True)
                    )
                    break
            assert exported is not None and not exported.kv_included
            with pytest.raises(grpc.aio.AioRpcError) as left:
                async for _ in second:
                    pass
            assert left.value.code() == grpc.StatusCode.ABORTED  # "moved": follow it
            imported = await stub.ImportSession(worker_pb2.ImportSessionRequest(blob=exported.blob))
            assert imported.generated >= 10 and not imported.kv_restored
            resumed = [
                m.token
                async for m in stub.Generate(
                    worker_pb2.GenerateRequest(resume_session_id="carried", resume_from_token=4)
                )
            ]
            assert first == served["g-1"][:10]
            assert resumed == served["g-1"][4:]  # replayed from index 4, then live to the end

        # vLLM's own counters reach the daemon and become the model's traffic mix.
        async def counted() -> fpb.WorkerStatus | None:
            for w in await listed(daemon):
                done = w.counters.decode_tokens >= TOKENS * len(SESSIONS)
                if w.worker_id == worker.worker_id and done:
                    return w
            return None

        status = await wait_for(counted, 30, "vLLM's generation counter did not reach the daemon")
        assert status.counters.prefill_tokens >= sum(len(p) for _, p in SESSIONS)
        assert status.counters.kv_blocks_total > 0
        assert 0 < status.counters.ttft_p50_ms <= status.counters.ttft_p99_ms
        assert 0 < status.counters.tbt_p50_ms <= status.counters.tbt_p99_ms

        # The daemon counts a worker's tokens from the first heartbeat it sees of it, so on a
        # quick machine the sessions above can fall entirely before that baseline (then the
        # window holds decode tokens only, ratio 0). One more session, served once the counters
        # are known to arrive, lands in the window whole: prefill and decode both.
        assert len(await one("mix", SESSIONS[1][1])) == TOKENS

        async def counters_mix() -> float | None:
            mix = await ppb_grpc.PlanningStub(daemon).GetTrafficMix(
                ppb.GetTrafficMixRequest(model=MODEL)
            )
            ratio = mix.models[0].prefill_decode_ratio
            return ratio if 0 < ratio < 1 else None  # the one request alone says 500

        ratio = await wait_for(counters_mix, 30, "the traffic mix did not take vLLM's counters")
        assert ratio > 0

        # Every session that ran to its length reached the daemon's output-length estimator
        # through the heartbeats, once each: the four, the carried one and the last one (the
        # re-attach probe was cancelled: not a finished request). Route without an expected
        # output now answers what they produced, not the 256-token prior.
        async def learned() -> int | None:
            mix = await ppb_grpc.PlanningStub(daemon).GetTrafficMix(
                ppb.GetTrafficMixRequest(model=MODEL)
            )
            n = {m.model: m.estimator_samples for m in mix.models}.get(MODEL, 0)
            return n if n >= len(SESSIONS) + 2 else None

        assert await wait_for(learned, 30, "finished sessions did not reach the estimator") == (
            len(SESSIONS) + 2
        )
        estimated = await placement.Route(ppb.RouteRequest(model=MODEL, prompt_tokens=40))
        assert estimated.output_estimated and estimated.output_tokens == TOKENS
        await ops.StopWorker(pb.StopFleetWorkerRequest(worker_id=worker.worker_id), timeout=60)
    fleet.stop()
    # vLLM alone (its offline engine, no FleetShift, same model and arguments): same tokens.
    assert served == vllm_alone(vllm_python, vllm_model, TOKENS, tmp_path)


async def test_engine_arguments_vllm_refuses_fail_the_start_by_name(fleet: LocalFleet) -> None:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await start_worker(ops, "cpu-a", BAD_MODEL)
        message = refused.value.details() or ""
        assert "VllmStartFailed" in message and "max_model_len" in message, message
        assert not [w for w in await listed(daemon) if w.state != fpb.WORKER_STATE_STOPPED]

        async with grpc.aio.insecure_channel(agent_address(fleet, "cpu-a")) as ch:
            agent = agent_pb2_grpc.AgentServiceStub(ch)
            info = await agent.GetAgentInfo(agent_pb2.GetAgentInfoRequest())
            assert "vllm" in info.engines and not info.workers  # serving on, nothing left
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await agent.StartWorker(
                    agent_pb2.StartWorkerRequest(
                        worker_id="w-sglang", model=MODEL, model_dir=str(fleet.state_dir),
                        role=fpb.WORKER_ROLE_MIXED, gpu_indices=[0], engine="sglang",
                    )
                )  # fmt: skip
            assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "engine 'sglang' is not known" in (unknown.value.details() or "")
            assert not (await agent.GetAgentInfo(agent_pb2.GetAgentInfoRequest())).workers
        # The agent and the node still take a good worker afterwards.
        worker = await start_worker(ops, "cpu-a")
        assert worker.state == fpb.WORKER_STATE_SERVING
