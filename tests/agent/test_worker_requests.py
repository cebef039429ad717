"""Requests the agent must refuse (naming the field), and a worker that dies under it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2, placement_pb2, placement_pb2_grpc
from fleetshift.v1 import fleet_pb2 as pb

from .fleet import agent_config, agent_stub, eventually, running_agent, start_request, worker_pid

pytestmark = pytest.mark.slow


async def _refused(call: object, code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    assert err.value.code() == code, err.value.details()
    assert field in (err.value.details() or ""), err.value.details()


async def test_bad_requests_are_refused_before_any_process_starts(
    daemon: object, tiny_model: Path, tmp_path: Path
) -> None:
    port = daemon.port  # type: ignore[attr-defined]
    state = tmp_path / "state"
    async with (
        running_agent(agent_config(port, "h100-x", state)) as agent,
        grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch,
    ):
        stub = agent_stub(ch)
        first = await stub.StartWorker(start_request("w0", tiny_model, gpus=(0,)), timeout=120)
        assert first.state == pb.WORKER_STATE_SERVING

        code = grpc.StatusCode
        await _refused(
            stub.StartWorker(start_request("w0", tiny_model, gpus=(1,))),
            code.ALREADY_EXISTS,
            "w0",
        )
        await _refused(
            stub.StartWorker(start_request("w1", tiny_model, gpus=(1, 0))),
            code.FAILED_PRECONDITION,
            "gpu_indices [0] are held by worker 'w0'",
        )
        await _refused(
            stub.StartWorker(start_request("w1", tiny_model, gpus=(2,))),
            code.FAILED_PRECONDITION,
            "gpu_indices [2] do not exist",
        )
        await _refused(
            stub.StartWorker(start_request("w1", gpus=(1,), snapshot_id="never-taken")),
            code.NOT_FOUND,
            "restore_snapshot_id",
        )
        await _refused(
            stub.StartWorker(start_request("w1", tmp_path / "no-such-model", gpus=(1,))),
            code.FAILED_PRECONDITION,
            "model_dir",
        )
        await _refused(
            stub.StartWorker(start_request("../w1", tiny_model, gpus=(1,))),
            code.INVALID_ARGUMENT,
            "worker_id",
        )
        await _refused(
            stub.StartWorker(start_request("w1", tiny_model, gpus=())),
            code.INVALID_ARGUMENT,
            "gpu_indices",
        )
        await _refused(
            stub.StopWorker(agent_pb2.StopWorkerRequest(worker_id="nobody")),
            code.NOT_FOUND,
            "worker_id",
        )
        await _refused(
            stub.SnapshotWorker(
                agent_pb2.SnapshotWorkerRequest(worker_id="nobody", snapshot_id="s")
            ),
            code.NOT_FOUND,
            "worker_id",
        )
        await _refused(
            stub.SnapshotWorker(
                agent_pb2.SnapshotWorkerRequest(worker_id="w0", snapshot_id="../s")
            ),
            code.INVALID_ARGUMENT,
            "snapshot_id",
        )
        await _refused(
            stub.FetchSnapshot(
                agent_pb2.FetchSnapshotRequest(
                    source_agent_address=f"127.0.0.1:{agent.port}", snapshot_id="never-taken"
                )
            ),
            code.NOT_FOUND,
            "never-taken",
        )
        info = await stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest())
        assert [w.worker_id for w in info.workers] == ["w0"]
        assert sorted(p.name for p in (state / "workers").glob("*.json")) == ["w0.json"]

        # A worker that dies is reported FAILED once, then no longer listed; its GPU is free.
        os.kill(worker_pid(state, "w0"), signal.SIGKILL)

        async def daemon_view() -> dict[str, int]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as dch:
                reply = await placement_pb2_grpc.PlanningStub(dch).ListWorkers(
                    placement_pb2.ListWorkersRequest()
                )
            return {w.worker_id: w.state for w in reply.workers}

        await eventually(daemon_view, lambda v: v.get("w0") == pb.WORKER_STATE_FAILED)
        await eventually(
            lambda: stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest()),
            lambda i: list(i.workers) == [],
        )
        # GPU 0 is free again: the same request now fails only on its missing model.
        await _refused(
            stub.StartWorker(start_request("w0", tmp_path / "no-such-model", gpus=(0,))),
            code.FAILED_PRECONDITION,
            "model_dir",
        )


async def test_a_worker_that_cannot_load_fails_the_call_and_leaves_nothing(
    daemon: object, tmp_path: Path
) -> None:
    port = daemon.port  # type: ignore[attr-defined]
    state = tmp_path / "state"
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    async with (
        running_agent(agent_config(port, "h100-y", state)) as agent,
        grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch,
    ):
        stub = agent_stub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StartWorker(start_request("w-bad", broken), timeout=120)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details() or ""
        assert "exited with status" in details and "log tail" in details, details
        # The exception that ended the worker, as one sentence, not a cut-off traceback.
        assert "Traceback" not in details and 'File "' not in details, details
        assert "\n" not in details, details
        info = await stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest())
        assert list(info.workers) == []
        assert list((state / "workers").glob("*.json")) == []
        # its GPU was never taken: the next request fails only on what it got wrong
        await _refused(
            stub.StartWorker(start_request("w-bad", tmp_path / "missing", gpus=(0,))),
            grpc.StatusCode.FAILED_PRECONDITION,
            "model_dir",
        )
