"""The worker's gRPC surface: statuses that name the field, info, counters, health."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fleetshift.v1 import fleet_pb2, worker_pb2
from fleetshift_agent.engine.weights import weights_digest

from .workers import WorkerProcess, Workers, stub, workers_in

pytestmark = pytest.mark.slow

OK_SAMPLING = worker_pb2.WorkerSampling(temperature=0.0)
_COUNTERS = worker_pb2.GetWorkerCountersRequest()


@pytest.fixture(scope="module")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    gen: Iterator[Workers] = workers_in(tmp_path_factory.mktemp("api-worker"))
    workers = next(gen)
    yield workers.start("--model-dir", str(tiny_model), "--role", "decode", "--num-blocks", "64")
    gen.close()


async def _generate_error(worker: WorkerProcess, req: worker_pb2.GenerateRequest) -> grpc.RpcError:
    async with worker.channel() as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub(ch).Generate(req):
                pass
    return err.value


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (worker_pb2.GenerateRequest(max_new_tokens=4), "prompt_tokens"),
        (worker_pb2.GenerateRequest(prompt_tokens=[1, 99999], max_new_tokens=4), "prompt_tokens"),
        (worker_pb2.GenerateRequest(prompt_tokens=[1], max_new_tokens=0), "max_new_tokens"),
        (
            worker_pb2.GenerateRequest(
                prompt_tokens=[1],
                max_new_tokens=4,
                sampling=worker_pb2.WorkerSampling(temperature=-0.5),
            ),
            "sampling.temperature",
        ),
        (
            worker_pb2.GenerateRequest(
                prompt_tokens=[1], max_new_tokens=4, sampling=worker_pb2.WorkerSampling(top_p=0.0)
            ),
            "sampling.top_p",
        ),
        (
            worker_pb2.GenerateRequest(
                prompt_tokens=[1], max_new_tokens=4, sampling=worker_pb2.WorkerSampling(top_p=1.01)
            ),
            "sampling.top_p",
        ),
        (worker_pb2.GenerateRequest(resume_from_token=3), "resume_from_token"),
        (
            worker_pb2.GenerateRequest(prompt_tokens=[1], max_new_tokens=4, tokens_per_message=257),
            "tokens_per_message",
        ),
    ],
    ids=[
        "empty-prompt",
        "token-out-of-vocab",
        "zero-new",
        "negative-temp",
        "top-p-0",
        "top-p-above-1",
        "resume-without-id",
        "tokens-per-message-over-256",
    ],
)
async def test_bad_generate_is_invalid_argument_naming_the_field(
    worker: WorkerProcess, request_: worker_pb2.GenerateRequest, field: str
) -> None:
    err = await _generate_error(worker, request_)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()


async def test_unknown_session_is_not_found_naming_the_field(worker: WorkerProcess) -> None:
    err = await _generate_error(worker, worker_pb2.GenerateRequest(resume_session_id="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "resume_session_id" in err.details()
    async with worker.channel() as ch:
        s = stub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as export_err:
            await s.ExportSession(worker_pb2.ExportSessionRequest(session_id="nope"))
        assert export_err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "session_id" in export_err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as import_err:
            await s.ImportSession(worker_pb2.ImportSessionRequest(blob=b"garbage" * 3))
        assert import_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "blob" in import_err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as snap_err:
            await s.Snapshot(worker_pb2.WorkerSnapshotRequest(snapshot_id="x"))
        assert snap_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dir" in snap_err.value.details()


async def test_info_reports_role_and_compat_key_and_role_can_change(
    worker: WorkerProcess, tiny_model: Path
) -> None:
    async with worker.channel() as ch:
        s = stub(ch)
        info = await s.GetInfo(worker_pb2.GetWorkerInfoRequest())
        assert info.role == fleet_pb2.WORKER_ROLE_DECODE
        assert info.compat_key.weights_digest == weights_digest(tiny_model)
        assert info.compat_key.engine_name == "fleetshift-ref"
        assert info.compat_key.dtype == "float32"
        assert info.model_id == tiny_model.name
        assert info.kv_blocks_total == 64
        assert info.role_epoch == 0
        changed = await s.SetRole(
            worker_pb2.SetWorkerRoleRequest(role=fleet_pb2.WORKER_ROLE_PREFILL)
        )
        assert changed.role == fleet_pb2.WORKER_ROLE_PREFILL and changed.role_epoch == 1
        # Setting the role it has is no change; a real change counts again.
        same = await s.SetRole(worker_pb2.SetWorkerRoleRequest(role=fleet_pb2.WORKER_ROLE_PREFILL))
        assert same.role_epoch == 1
        back = await s.SetRole(worker_pb2.SetWorkerRoleRequest(role=fleet_pb2.WORKER_ROLE_DECODE))
        assert back.role_epoch == 2
        assert (await s.GetInfo(worker_pb2.GetWorkerInfoRequest())).role_epoch == 2
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.SetRole(worker_pb2.SetWorkerRoleRequest(role=fleet_pb2.WORKER_ROLE_UNSPECIFIED))
        assert "role" in err.value.details()


async def test_a_draining_worker_refuses_new_sessions_and_finishes_live_ones(
    worker: WorkerProcess,
) -> None:
    async with worker.channel() as ch:
        s = stub(ch)
        live = s.Generate(
            worker_pb2.GenerateRequest(
                prompt_tokens=[1, 2, 3], max_new_tokens=40, sampling=OK_SAMPLING
            )
        )
        streamed = [await live.read() for _ in range(3)]
        try:
            info = await s.SetDraining(worker_pb2.SetWorkerDrainingRequest(draining=True))
            assert info.draining
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in s.Generate(
                    worker_pb2.GenerateRequest(
                        prompt_tokens=[4], max_new_tokens=2, sampling=OK_SAMPLING
                    )
                ):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (refused.value.details() or "")
            while (msg := await live.read()) is not grpc.aio.EOF:  # the live one streams on
                streamed.append(msg)
            assert [m.index for m in streamed] == list(range(40)) and streamed[-1].finished
        finally:
            undrained = await s.SetDraining(worker_pb2.SetWorkerDrainingRequest())
        assert not undrained.draining
        again = [
            m
            async for m in s.Generate(
                worker_pb2.GenerateRequest(
                    prompt_tokens=[4], max_new_tokens=2, sampling=OK_SAMPLING
                )
            )
        ]
        assert len(again) == 2


async def test_counters_follow_a_generation(worker: WorkerProcess) -> None:
    async with worker.channel() as ch:
        s = stub(ch)
        before = await s.GetCounters(worker_pb2.GetWorkerCountersRequest())
        req = worker_pb2.GenerateRequest(
            prompt_tokens=list(range(20)), max_new_tokens=6, sampling=OK_SAMPLING
        )
        tokens = [m async for m in s.Generate(req)]
        after = await s.GetCounters(worker_pb2.GetWorkerCountersRequest())
    assert [m.index for m in tokens] == list(range(6))
    assert tokens[-1].finished and tokens[-1].finish_reason == "length"
    assert not any(m.finished for m in tokens[:-1])
    assert after.prefill_tokens - before.prefill_tokens == 20
    assert after.decode_tokens - before.decode_tokens == 5
    assert after.kv_blocks_total == 64 and after.kv_blocks_used == 0
    assert after.ttft_p50_ms > 0 and after.tbt_p99_ms >= after.tbt_p50_ms > 0


async def test_a_stream_of_several_tokens_per_message_carries_the_same_tokens(
    worker: WorkerProcess,
) -> None:
    """tokens_per_message packs the tokens the worker already has: a live stream carries
    exactly the tokens of a one-per-message run, and a re-attach to a finished session gets
    them four to a message, each message at its first token's index, the last one finished."""
    async with worker.channel() as ch:
        s = stub(ch)

        def req(sid: str, per_message: int) -> worker_pb2.GenerateRequest:
            return worker_pb2.GenerateRequest(
                prompt_tokens=list(range(3, 23)),
                max_new_tokens=10,
                sampling=OK_SAMPLING,
                session_id=sid,
                tokens_per_message=per_message,
            )

        single = [m async for m in s.Generate(req("one-each", 0))]
        packed = [m async for m in s.Generate(req("packed", 8))]
        again = worker_pb2.GenerateRequest(
            resume_session_id="packed", resume_from_token=1, tokens_per_message=4
        )
        replay = [m async for m in s.Generate(again)]
    assert all(not m.more_tokens for m in single) and len(single) == 10
    reference = [m.token for m in single]
    assert [t for m in packed for t in (m.token, *m.more_tokens)] == reference
    assert packed[-1].finished and packed[-1].finish_reason == "length"
    assert [(m.index, len(m.more_tokens) + 1) for m in replay] == [(1, 4), (5, 4), (9, 1)]
    assert [t for m in replay for t in (m.token, *m.more_tokens)] == reference[1:]
    assert [m.finished for m in replay] == [False, False, True]


async def test_a_client_that_leaves_frees_its_session(worker: WorkerProcess) -> None:
    async with worker.channel() as ch:
        s = stub(ch)
        req = worker_pb2.GenerateRequest(
            prompt_tokens=[5, 6], max_new_tokens=400, sampling=OK_SAMPLING, session_id="leaver"
        )
        call = s.Generate(req)
        await call.read()
        call.cancel()
        for _ in range(200):
            counters = await s.GetCounters(worker_pb2.GetWorkerCountersRequest())
            if counters.live_sessions == 0:
                break
            await asyncio.sleep(0.02)
        assert counters.live_sessions == 0 and counters.kv_blocks_used == 0


async def test_a_client_that_leaves_a_backed_up_stream_frees_its_session(
    worker: WorkerProcess,
) -> None:
    """A client that stops reading and then leaves: the worker is still writing tokens it
    has not sent (the client's window is full), so grpc cancels it mid-write, not while it
    waits for a token. The session ends all the same, on a paused worker too (it cannot end
    by itself there). CI once saw such sessions decode to their end with nobody reading."""
    slow_reader = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
    async with (
        grpc.aio.insecure_channel(worker.address, options=slow_reader) as ch,
        worker.channel() as control_ch,
    ):
        s, control = stub(ch), stub(control_ch)
        req = worker_pb2.GenerateRequest(
            prompt_tokens=[5, 6], max_new_tokens=400, sampling=OK_SAMPLING, session_id="backed-up"
        )
        await control.Pause(worker_pb2.WorkerPauseRequest())
        try:
            call = s.Generate(req)
            while (await control.GetCounters(_COUNTERS)).live_sessions < 1:
                await asyncio.sleep(0.02)
            state = await control.Resume(worker_pb2.WorkerResumeRequest(steps=120))
            while (await control.GetInfo(worker_pb2.GetWorkerInfoRequest())).paused is False:
                await asyncio.sleep(0.02)
            assert (await call.read()).index == 0  # then nothing more is read
            call.cancel()
            for _ in range(200):
                counters = await control.GetCounters(_COUNTERS)
                if counters.live_sessions == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            await control.Resume(worker_pb2.WorkerResumeRequest())
    assert counters.live_sessions == 0 and counters.kv_blocks_used == 0, counters
    assert state.paused is False


async def test_health_and_reflection_are_on(worker: WorkerProcess) -> None:
    async with worker.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in refl.ServerReflectionInfo(iter([request])):
            names = {s.name for s in response.list_services_response.service}
            break
    assert "fleetshift.v1.WorkerService" in names
