"""A move between two vLLM workers while sessions stream: the daemon plans it cold (vLLM has
no snapshot here, even between nodes of the same GPU model), carries every session as its
token history, and each client's stream goes on with exactly the tokens vLLM alone gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import follow_session
from tests.vllm.conftest import SESSIONS, request, vllm_alone
from tests.vllm.test_vllm_workers import start_worker

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TOKENS = 96
HOLD = 8  # each session waits after this many tokens until the test pauses the worker


async def test_a_move_carries_every_session_with_vllms_own_tokens(
    fleet: LocalFleet, vllm_python: str, vllm_model: Path, tmp_path: Path
) -> None:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await start_worker(ops, "cpu-a")
        seen: dict[str, int] = {}
        started = asyncio.Event()

        async def one(sid: str, prompt: list[int]) -> list[int]:
            tokens = []
            async for msg in follow_session(
                daemon, worker.endpoint, request(sid, prompt, TOKENS, hold=HOLD)
            ):
                tokens.append(msg.token)
                seen[sid] = len(tokens)
                if len(seen) == len(SESSIONS) and min(seen.values()) >= HOLD:
                    started.set()
            return tokens

        streams = asyncio.gather(*(one(*s) for s in SESSIONS))
        await asyncio.wait_for(started.wait(), 300)
        # Hold the sessions where they are (vLLM's pause, keep mode) so that they are still
        # mid-stream when the move copies them, however long the target takes to start here.
        async with grpc.aio.insecure_channel(worker.endpoint) as ch:
            state = await worker_pb2_grpc.WorkerServiceStub(ch).Pause(
                worker_pb2.WorkerPauseRequest()
            )
            assert state.paused
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node="cpu-b", reason="vllm"),
            timeout=30,
        )
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
        assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
        (step,) = op.steps
        assert step.kind == pb.STEP_KIND_COLD_START  # same GPU model, but vLLM moves cold
        assert step.sessions_carried == len(SESSIONS)
        results = await asyncio.wait_for(streams, 600)
    moved = {sid: tokens for (sid, _), tokens in zip(SESSIONS, results, strict=True)}
    assert all(len(t) == TOKENS for t in moved.values())
    fleet.stop()
    assert moved == vllm_alone(vllm_python, vllm_model, TOKENS, tmp_path)
