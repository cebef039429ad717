"""Live moves: pre-copy while decoding, stage at the target, stop only for the final delta.

The source keeps generating after the pre-copy; the delta taken at the release carries what
changed. The target must continue with exactly the tokens of an uninterrupted run, a delta
made against another base must be refused by field without touching the staged copy, and the
delta must stay small whatever the context length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine import Engine, SamplingParams, SessionExport
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_common.errors import FailedPrecondition, InvalidArgument, NotFound

from .helpers import REQUESTS, Request, add_all, drain, new_engine, run_all
from .workers import Workers, generate_request, resume, stub, workers_in


def _run(engine: Engine, steps: int, out: dict[str, list[int]]) -> None:
    for _ in range(steps):
        for ev in engine.step():
            out.setdefault(ev.session_id, []).append(ev.token)


def _carry(blob: bytes) -> SessionExport:
    return SessionExport.from_bytes(blob)  # every hop goes through bytes, as over the wire


@pytest.mark.parametrize(
    ("pre_steps", "more_steps"),
    [(2, 8), (0, 3), (5, 1)],
    ids=["precopy-then-8-steps", "precopy-before-prefill", "one-step-delta"],
)
def test_precopy_then_delta_continues_exactly_as_uninterrupted(
    tiny_model: Path, pre_steps: int, more_steps: int
) -> None:
    reference = run_all(tiny_model, REQUESTS)
    source, dest = new_engine(tiny_model), new_engine(tiny_model)
    add_all(source, REQUESTS)
    out: dict[str, list[int]] = {}
    _run(source, pre_steps, out)
    base = {}
    for sid in REQUESTS:
        exp = source.export_session(sid, with_kv=True)
        base[sid] = len(exp.description["tokens"])
        staged = dest.import_session(_carry(exp.to_bytes()), staged=True)
        assert staged.session_id == sid
    assert not dest.has_work() and dest.step() == []  # staged copies do not generate
    _run(source, more_steps, out)  # the source keeps decoding meanwhile
    for sid in REQUESTS:
        delta = source.export_session(sid, with_kv=True, from_token=base[sid])
        source.cancel(sid)
        assert len(delta.description["tokens"]) == more_steps
        dest.apply_delta(sid, _carry(delta.to_bytes()))
    assert drain(dest, out) == reference
    assert source.kv.used_blocks == 0 and dest.kv.used_blocks == 0


def test_delta_kv_is_a_few_blocks_whatever_the_context(tiny_model: Path) -> None:
    sizes = {}
    for n in (40, 400):
        engine = new_engine(tiny_model)
        engine.add_session("s", list(range(1, n + 1)), 20, SamplingParams())
        _run(engine, 3, {})
        full = engine.export_session("s", with_kv=True)
        base = len(full.description["tokens"])
        _run(engine, 4, {})
        delta = engine.export_session("s", with_kv=True, from_token=base)
        assert delta.k is not None
        assert delta.k.shape[1] <= engine.kv.block_size + 4
        sizes[n] = (len(full.to_bytes()), len(delta.to_bytes()))
    assert sizes[400][0] > 5 * sizes[40][0]  # the full copy grows with the context
    assert sizes[400][1] < 1.2 * sizes[40][1]  # the delta does not


def _staged_pair(model: Path, sid: str, req: Request) -> tuple[Engine, Engine, int]:
    source, dest = new_engine(model), new_engine(model)
    add_all(source, {sid: req})
    _run(source, 3, {})
    exp = source.export_session(sid, with_kv=True)
    dest.import_session(_carry(exp.to_bytes()), staged=True)
    return source, dest, len(exp.description["tokens"])


def test_delta_against_another_base_is_refused_by_field_and_changes_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    sid = "seeded-topp"
    reference = run_all(tiny_model, {sid: REQUESTS[sid]})[sid]
    source, dest, base = _staged_pair(tiny_model, sid, REQUESTS[sid])
    staged = dest.staged[sid]
    before = (list(staged.tokens), staged.cached, list(staged.blocks))
    _run(source, 2, {})
    wrong_count = source.export_session(sid, with_kv=True, from_token=base - 1)
    other = new_engine(tiny_model)
    add_all(other, {"greedy-long": REQUESTS["greedy-long"]})
    _run(other, 3, {})
    wrong_session = other.export_session("greedy-long", with_kv=True, from_token=base)
    make_model(["--out", str(tmp_path), "--preset", "tiny", "--seed", "8"])
    foreign = new_engine(tmp_path)
    add_all(foreign, {sid: REQUESTS[sid]})
    _run(foreign, 5, {})
    wrong_model = foreign.export_session(sid, with_kv=True, from_token=base)
    for delta, field in [
        (wrong_count, "from_token"),
        (wrong_session, "session_id"),
        (wrong_model, "weights_digest"),
    ]:
        with pytest.raises(FailedPrecondition) as err:
            dest.apply_delta(sid, _carry(delta.to_bytes()))
        assert err.value.field == field
        assert (staged.tokens, staged.cached, staged.blocks) == before
        assert sid in dest.staged and not dest.has_work()
    with pytest.raises(NotFound) as missing:
        dest.apply_delta("nobody", wrong_count)
    assert missing.value.field == "delta_for"
    with pytest.raises(InvalidArgument) as not_full:
        dest.import_session(wrong_count)
    assert not_full.value.field == "delta_for"
    good = source.export_session(sid, with_kv=True, from_token=base)
    dest.apply_delta(sid, _carry(good.to_bytes()))
    assert dest.get(sid).generated + drain(dest, {})[sid] == reference


def test_cancelling_a_staged_session_frees_its_kv(tiny_model: Path) -> None:
    _, dest, _ = _staged_pair(tiny_model, "greedy-long", REQUESTS["greedy-long"])
    assert dest.kv.used_blocks > 0
    dest.cancel("greedy-long")
    assert dest.kv.used_blocks == 0 and not dest.staged


# ---- over gRPC, between two worker processes -------------------------------------------


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    yield from workers_in(tmp_path)


async def _read(calls: dict[str, object], received: dict[str, list[int]], n: int) -> None:
    for sid, call in calls.items():
        for _ in range(n):
            received[sid].append((await call.read()).token)  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_live_move_between_workers_keeps_every_token(
    tiny_model: Path, workers: Workers
) -> None:
    """Pre-copy while the source decodes; the client's stream ends; it resumes at the target."""
    reference = run_all(tiny_model, REQUESTS)
    source = workers.start("--model-dir", str(tiny_model), "--start-paused")
    target = workers.start("--model-dir", str(tiny_model))
    async with source.channel() as src_ch, target.channel() as dst_ch:
        src, dst = stub(src_ch), stub(dst_ch)
        calls = {sid: src.Generate(generate_request(sid, req)) for sid, req in REQUESTS.items()}
        received: dict[str, list[int]] = {sid: [] for sid in REQUESTS}
        while (await src.GetCounters(worker_pb2.GetWorkerCountersRequest())).live_sessions < 4:
            await asyncio.sleep(0.02)
        await src.Resume(worker_pb2.WorkerResumeRequest(steps=2))
        await _read(calls, received, 2)
        bases = {}
        for sid in REQUESTS:
            pre = await src.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True)
            )
            bases[sid] = pre.tokens
            staged = await dst.ImportSession(
                worker_pb2.ImportSessionRequest(blob=pre.blob, staged=True)
            )
            assert staged.staged and staged.kv_restored
        info = await dst.GetInfo(worker_pb2.GetWorkerInfoRequest())
        assert sorted(info.staged_session_ids) == sorted(REQUESTS) and not info.session_ids
        await src.Resume(worker_pb2.WorkerResumeRequest(steps=5))  # decodes on, then pauses
        await _read(calls, received, 5)
        for sid in REQUESTS:
            delta = await src.ExportSession(
                worker_pb2.ExportSessionRequest(
                    session_id=sid, with_kv=True, release=True, from_token=bases[sid]
                )
            )
            assert delta.delta and delta.tokens == bases[sid] + 5
            applied = await dst.ImportSession(
                worker_pb2.ImportSessionRequest(blob=delta.blob, delta_for=sid)
            )
            assert applied.kv_restored and not applied.staged
        for sid, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    msg = await call.read()  # type: ignore[attr-defined]
                    assert msg is not grpc.aio.EOF
                    received[sid].append(msg.token)
            assert err.value.code() == grpc.StatusCode.ABORTED
        for sid in REQUESTS:
            received[sid] += await resume(dst, sid, received[sid])
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=delta.blob, delta_for=sid))
        assert bad.value.code() == grpc.StatusCode.NOT_FOUND and "delta_for" in str(bad.value)
    assert received == reference


@pytest.mark.slow
async def test_a_staged_copy_can_be_dropped_and_bad_moves_name_their_field(
    tiny_model: Path, workers: Workers
) -> None:
    """The executor's rollback: the source session ended (or the move failed) after staging."""
    source = workers.start("--model-dir", str(tiny_model), "--start-paused")
    target = workers.start("--model-dir", str(tiny_model))
    sid = "greedy-long"
    async with source.channel() as src_ch, target.channel() as dst_ch:
        src, dst = stub(src_ch), stub(dst_ch)
        call = src.Generate(generate_request(sid, REQUESTS[sid]))
        await src.Resume(worker_pb2.WorkerResumeRequest(steps=2))
        await _read({sid: call}, {sid: []}, 2)
        pre = await src.ExportSession(worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True))
        await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=pre.blob, staged=True))
        with pytest.raises(grpc.aio.AioRpcError) as past:
            await src.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, from_token=pre.tokens + 1)
            )
        assert past.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "from_token" in (past.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as twice:
            await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=pre.blob, staged=True))
        assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS
        used = (await dst.GetCounters(worker_pb2.GetWorkerCountersRequest())).kv_blocks_used
        assert used > 0
        await dst.CancelSession(worker_pb2.CancelSessionRequest(session_id=sid))
        info = await dst.GetInfo(worker_pb2.GetWorkerInfoRequest())
        counters = await dst.GetCounters(worker_pb2.GetWorkerCountersRequest())
        assert not info.staged_session_ids and counters.kv_blocks_used == 0
        delta = await src.ExportSession(
            worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True, from_token=pre.tokens)
        )
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=delta.blob, delta_for=sid))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as not_full:
            await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=delta.blob))
        assert not_full.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "delta_for" in (not_full.value.details() or "")
        call.cancel()


@pytest.mark.slow
async def test_make_before_break_move_pauses_the_source_only_for_the_deltas(
    tiny_model: Path, workers: Workers
) -> None:
    """The executor's order: pre-copy while decoding, Pause, deltas without release, then
    cancel at the source once the target holds every session (a rollback would Resume)."""
    reference = run_all(tiny_model, REQUESTS)
    source = workers.start("--model-dir", str(tiny_model), "--start-paused")
    target = workers.start("--model-dir", str(tiny_model))
    async with source.channel() as src_ch, target.channel() as dst_ch:
        src, dst = stub(src_ch), stub(dst_ch)
        calls = {sid: src.Generate(generate_request(sid, req)) for sid, req in REQUESTS.items()}
        received: dict[str, list[int]] = {sid: [] for sid in REQUESTS}
        while (await src.GetCounters(worker_pb2.GetWorkerCountersRequest())).live_sessions < 4:
            await asyncio.sleep(0.02)
        await src.Resume(worker_pb2.WorkerResumeRequest(steps=1))
        await _read(calls, received, 1)
        bases = {}
        for sid in REQUESTS:
            pre = await src.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True)
            )
            await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=pre.blob, staged=True))
            bases[sid] = pre.tokens
        await src.Resume(worker_pb2.WorkerResumeRequest(steps=6))
        await _read(calls, received, 6)
        await src.Pause(worker_pb2.WorkerPauseRequest())
        for sid in REQUESTS:
            delta = await src.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True, from_token=bases[sid])
            )
            applied = await dst.ImportSession(
                worker_pb2.ImportSessionRequest(blob=delta.blob, delta_for=sid)
            )
            assert applied.kv_restored and applied.tokens == bases[sid] + 6
        for sid in REQUESTS:  # the switch: only now does the source let go
            await src.CancelSession(worker_pb2.CancelSessionRequest(session_id=sid))
        for sid, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    msg = await call.read()  # type: ignore[attr-defined]
                    assert msg is not grpc.aio.EOF
                    received[sid].append(msg.token)
            assert err.value.code() == grpc.StatusCode.ABORTED
        for sid in REQUESTS:
            received[sid] += await resume(dst, sid, received[sid])
    assert received == reference
