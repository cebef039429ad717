"""Worker processes: snapshot + SIGKILL + restore, and session moves between workers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import worker_pb2

from .helpers import REQUESTS, run_all
from .workers import Workers, generate_request, resume, stub, workers_in

pytestmark = pytest.mark.slow


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    yield from workers_in(tmp_path)


async def _start_all(s: object, steps: int) -> tuple[dict[str, object], dict[str, list[int]]]:
    """Starts every request on a paused worker, runs exactly ``steps`` steps, reads them."""
    calls = {sid: s.Generate(generate_request(sid, req)) for sid, req in REQUESTS.items()}  # type: ignore[attr-defined]
    while (await s.GetCounters(worker_pb2.GetWorkerCountersRequest())).live_sessions < len(calls):  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    await s.Resume(worker_pb2.WorkerResumeRequest(steps=steps))  # type: ignore[attr-defined]
    received: dict[str, list[int]] = {sid: [] for sid in REQUESTS}
    for sid, call in calls.items():
        for _ in range(steps):
            msg = await call.read()  # type: ignore[attr-defined]
            received[sid].append(msg.token)
    return calls, received


async def test_snapshot_sigkill_and_restore_continue_every_session_exactly(
    tiny_model: Path, tmp_path: Path, workers: Workers
) -> None:
    reference = run_all(tiny_model, REQUESTS)
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    first = workers.start("--model-dir", str(tiny_model), "--start-paused")
    async with first.channel() as ch:
        s = stub(ch)
        _, received = await _start_all(s, steps=4)
        paused = await s.Pause(worker_pb2.WorkerPauseRequest())
        assert paused.paused and paused.steps == 4
        snap = await s.Snapshot(worker_pb2.WorkerSnapshotRequest(dir=str(snaps), snapshot_id="mid"))
        assert sorted(snap.session_ids) == sorted(REQUESTS)
        still = await s.Pause(worker_pb2.WorkerPauseRequest())
        assert still.steps == paused.steps  # nothing moved while paused
        first.sigkill()
    assert all(len(received[sid]) < len(reference[sid]) for sid in REQUESTS)

    second = workers.start("--restore-from", snap.path)
    async with second.channel() as ch:
        s = stub(ch)
        info = await s.GetInfo(worker_pb2.GetWorkerInfoRequest())
        assert info.restored_from == "mid"
        for sid in REQUESTS:
            received[sid] += await resume(s, sid, received[sid])
    assert received == reference


async def test_restore_rpc_into_a_running_worker(
    tiny_model: Path, tmp_path: Path, workers: Workers
) -> None:
    reference = run_all(tiny_model, REQUESTS)
    source = workers.start("--model-dir", str(tiny_model), "--start-paused")
    target = workers.start("--model-dir", str(tiny_model))
    async with source.channel() as ch:
        s = stub(ch)
        _, received = await _start_all(s, steps=2)
        snap = await s.Snapshot(
            worker_pb2.WorkerSnapshotRequest(dir=str(tmp_path), snapshot_id="s1")
        )
    source.sigkill()
    async with target.channel() as ch:
        t = stub(ch)
        restored = await t.Restore(worker_pb2.WorkerRestoreRequest(path=snap.path))
        assert sorted(restored.kv_restored) == sorted(REQUESTS)
        assert restored.compat.startswith("compatible")
        for sid in REQUESTS:
            received[sid] += await resume(t, sid, received[sid])
    assert received == reference


async def test_sessions_exported_with_kv_and_as_tokens_continue_in_another_worker(
    tiny_model: Path, workers: Workers
) -> None:
    reference = run_all(tiny_model, REQUESTS)
    source = workers.start("--model-dir", str(tiny_model), "--start-paused")
    target = workers.start("--model-dir", str(tiny_model))
    with_kv = {"greedy-long", "seeded-topp"}
    async with source.channel() as src_ch, target.channel() as dst_ch:
        src, dst = stub(src_ch), stub(dst_ch)
        calls, received = await _start_all(src, steps=3)
        for sid in REQUESTS:
            exported = await src.ExportSession(
                worker_pb2.ExportSessionRequest(
                    session_id=sid, with_kv=sid in with_kv, release=True
                )
            )
            assert exported.kv_included == (sid in with_kv)
            imported = await dst.ImportSession(worker_pb2.ImportSessionRequest(blob=exported.blob))
            assert imported.kv_restored == (sid in with_kv)
        for sid, call in calls.items():  # the source's streams end: the session moved
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    msg = await call.read()  # type: ignore[attr-defined]
                    assert msg is not grpc.aio.EOF, "a moved session's stream must not end OK"
                    received[sid].append(msg.token)
            assert err.value.code() == grpc.StatusCode.ABORTED
        for sid in REQUESTS:
            received[sid] += await resume(dst, sid, received[sid])
        counters = await src.GetCounters(worker_pb2.GetWorkerCountersRequest())
    assert received == reference
    assert counters.live_sessions == 0 and counters.kv_blocks_used == 0
