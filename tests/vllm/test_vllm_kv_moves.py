"""Sessions move between vLLM workers with their KV, through vLLM's own disk connector.

What a user sees: a MoveWorker between two vLLM workers of the same compatibility key
carries every session's KV (the operation's step counts the sessions whose KV the target
restored, from vLLM's own external prefix-cache counter), and each greedy client stream
goes on with exactly vLLM alone's tokens. A seeded sampled session keeps its tokens before
the move and continues after it exactly as vLLM alone continues that context with that
seed: vLLM seeds a request's generator when the request starts, so the draws after a move
restart from the seed and are not the uninterrupted run's. When the KV cannot travel (here:
the store emptied between export and import) the destination recomputes the context from
the token history, says so, and the tokens are the same.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import time
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import follow_session
from tests.vllm.conftest import KV_MODEL, KV_STORE, vllm_alone_runs
from tests.vllm.test_vllm_workers import start_worker, worker_pair

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
TOKENS = 160  # long enough to still run on the target when each client relocates
BLOCK = 128  # vLLM's KV block on a CPU: only whole blocks travel
SEED = 1234
KEPT = 300  # a session that stays on the source through two Pauses and Resumes


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# Contexts longer than a vLLM block, so that KV travels; one seeded sampled session.
GREEDY = [("kv-1", prompt(150, 1)), ("kv-2", prompt(200, 2)), ("kv-3", prompt(262, 3))]
SEEDED = ("kv-s", prompt(180, 4))


def stored(fleet: LocalFleet) -> list[str]:
    """What the disk connector's store holds now."""
    store = fleet.state_dir / KV_STORE
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


def greq(
    sid: str, toks: list[int], n: int, seed: int | None = None, hold: int = 0
) -> worker_pb2.GenerateRequest:
    sampling = worker_pb2.WorkerSampling(temperature=0.0)
    if seed is not None:
        sampling = worker_pb2.WorkerSampling(temperature=1.0, seed=seed)
    return worker_pb2.GenerateRequest(
        prompt_tokens=toks, max_new_tokens=n, sampling=sampling, session_id=sid,
        hold_after_tokens=hold,
    )  # fmt: skip


def run(toks: list[int], n: int, seed: int | None = None) -> dict[str, object]:
    return {"prompt": toks, "max_tokens": n, "temperature": 1.0 if seed else 0.0,
            "seed": seed or 0}  # fmt: skip


async def test_a_move_carries_kv_through_the_connector(
    fleet: LocalFleet, vllm_python: str, vllm_model: Path, tmp_path: Path
) -> None:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        worker = await start_worker(ops, "cpu-a", KV_MODEL)
        seen: dict[str, int] = {}
        started = asyncio.Event()
        sessions = [(sid, p, None) for sid, p in GREEDY] + [(*SEEDED, SEED)]

        async def one(sid: str, toks: list[int], seed: int | None) -> list[int]:
            out = []
            async for msg in follow_session(
                daemon, worker.endpoint, greq(sid, toks, TOKENS, seed, hold=8)
            ):
                out.append(msg.token)
                seen[sid] = len(out)
                if len(seen) == len(sessions) and min(seen.values()) >= 8:
                    started.set()
            return out

        streams = asyncio.gather(*(one(*s) for s in sessions))
        await asyncio.wait_for(started.wait(), 300)
        assert stored(fleet) == []  # ordinary requests never write the store
        async with grpc.aio.insecure_channel(worker.endpoint) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            assert (await stub.Pause(worker_pb2.WorkerPauseRequest())).paused
            # Paused: every session is held where it stands; the seeded one's token count
            # there is where its tokens from vLLM alone must split.
            held = await stub.ExportSession(worker_pb2.ExportSessionRequest(session_id=SEEDED[0]))
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node="cpu-b", reason="kv"),
            timeout=30,
        )
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
        assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
        (step,) = op.steps
        assert step.kind == pb.STEP_KIND_COLD_START
        assert step.sessions_carried == len(sessions)
        # The record says which path: every session's KV arrived (vLLM's counter grew).
        assert step.sessions_kv_restored == len(sessions), step
        results = await asyncio.wait_for(streams, 600)
    fleet.stop()
    # Each export's KV was written (the target loaded it) and deleted once imported.
    assert stored(fleet) == []
    got = {sid: toks for (sid, _, _), toks in zip(sessions, results, strict=True)}
    assert all(len(t) == TOKENS for t in got.values())
    n = held.generated
    seeded = got[SEEDED[0]]
    runs = [run(p, TOKENS) for _, p in GREEDY]
    runs += [run(SEEDED[1], TOKENS, SEED), run(SEEDED[1] + seeded[:n], TOKENS - n, SEED)]
    alone = vllm_alone_runs(vllm_python, vllm_model, runs, tmp_path)
    assert {sid: got[sid] for sid, _ in GREEDY} == {
        sid: toks for (sid, _), toks in zip(GREEDY, alone, strict=False)
    }
    uninterrupted, continued = alone[-2], alone[-1]
    assert 8 <= n < TOKENS
    assert seeded[:n] == uninterrupted[:n]  # before the move: the uninterrupted draw
    assert seeded[n:] == continued  # after: vLLM alone on that context, seeded afresh
    assert seeded[n:] != uninterrupted[n:]  # so not the uninterrupted draws (temperature 1)


async def test_kv_that_cannot_travel_is_recomputed_and_said(
    fleet: LocalFleet, vllm_python: str, vllm_model: Path, tmp_path: Path
) -> None:
    """Worker to worker, as the executor does it: with the KV, and with the store emptied
    between export and import; the import's answer says which, and the tokens agree. A
    session that stays on the source through the Pause and Resume (held, then restarted
    from its tokens) gives vLLM alone's tokens too.

    Every session is started with ``hold_after_tokens``, so each stands at a known token
    when the worker is paused however fast vLLM decodes and however slowly this client
    reacts: CI once saw a 160-token session end between a Resume and the next Pause."""
    store = fleet.state_dir / KV_STORE
    async with worker_pair(fleet, KV_MODEL) as (a, b):
        cases = {"with-kv": prompt(300, 5), "emptied": prompt(300, 6)}
        notes: dict[str, worker_pb2.ImportSessionResponse] = {}
        took: dict[str, float] = {}
        kept = prompt(200, 7)
        kept_call = a.Generate(greq("kept", kept, KEPT, hold=1))
        kept_tokens = [(await kept_call.read()).token]
        firsts = {sid: a.Generate(greq(sid, toks, TOKENS, hold=8)) for sid, toks in cases.items()}
        for first in firsts.values():
            for _ in range(8):
                await first.read()
        await a.Pause(worker_pb2.WorkerPauseRequest())
        for sid, first in firsts.items():
            still = await a.ExportSession(worker_pb2.ExportSessionRequest(session_id="kept"))
            assert still.generated == 1  # held where it stood
            exp = await a.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True)
            )
            assert exp.kv_included and exp.generated == 8
            assert len(stored(fleet)) == 1  # this export's folder, and only it
            if sid == "emptied":
                for entry in store.iterdir():
                    shutil.rmtree(entry)
            t0 = time.monotonic()
            notes[sid] = await b.ImportSession(worker_pb2.ImportSessionRequest(blob=exp.blob))
            took[sid] = time.monotonic() - t0
            assert stored(fleet) == []  # imported: its folder is gone
            await a.CancelSession(worker_pb2.CancelSessionRequest(session_id=sid))
            first.cancel()
        await a.Resume(worker_pb2.WorkerResumeRequest())
        while (more := await kept_call.read()) != grpc.aio.EOF:
            kept_tokens.append(more.token)
        moved = {}
        for sid in cases:
            stream = b.Generate(worker_pb2.GenerateRequest(resume_session_id=sid))
            moved[sid] = [m.token async for m in stream]
    fleet.stop()
    kv, emptied = notes["with-kv"], notes["emptied"]
    context = kv.tokens
    assert kv.kv_restored, kv.kv_note
    loaded = int(re.search(r"(\d+) of (\d+) context tokens loaded", kv.kv_note).group(1))  # type: ignore[union-attr]
    assert loaded == (context - 1) // BLOCK * BLOCK > 0, kv.kv_note
    assert not emptied.kv_restored and "loaded none" in emptied.kv_note, emptied.kv_note
    print(
        f"\nimport of a {context}-token context: KV {took['with-kv'] * 1000:.0f} ms "
        f"({kv.kv_note}); token history {took['emptied'] * 1000:.0f} ms ({emptied.kv_note})"
    )
    runs = [run(p, TOKENS) for p in cases.values()] + [run(kept, KEPT)]
    alone = vllm_alone_runs(vllm_python, vllm_model, runs, tmp_path)
    assert moved == dict(zip(cases, alone, strict=False))
    assert kept_tokens == alone[-1]


async def test_a_precopied_session_pauses_only_for_its_tokens(
    fleet: LocalFleet, vllm_python: str, vllm_model: Path, tmp_path: Path
) -> None:
    """Worker to worker, as the executor's pre-copy does it on the disk connector: the base
    export stores the context's KV while the session decodes on (it is not held), the
    target stages it and loads it into its vLLM at once, and after the Pause the final delta
    writes no KV (the store holds the base's folder only); the session starts on the target
    from the base's blocks, found in its prefix cache, computes the tokens after them, and
    the client's tokens equal vLLM alone's."""
    async with worker_pair(fleet, KV_MODEL) as (a, b):
        # 140 tokens: one whole block travels. The session stops at HOLD tokens and waits for
        # its hand-over if the test has not paused it by then, so however fast vLLM decodes
        # and however slowly this client reads, it is live at the Pause (CI once saw a
        # 200-token session end first) and its tail past the export stays within TAIL_TOKENS.
        toks, n, hold = prompt(140, 8), 360, 200
        call = a.Generate(greq("pre", toks, n, hold=hold))
        got = [(await call.read()).token]
        base = await a.ExportSession(
            worker_pb2.ExportSessionRequest(session_id="pre", with_kv=True)
        )
        assert base.kv_included and not base.delta
        staged = await b.ImportSession(worker_pb2.ImportSessionRequest(blob=base.blob, staged=True))
        # Staged: the KV is loaded into the target's vLLM now, not at the switch.
        assert staged.staged and staged.kv_restored, staged.kv_note
        assert "loaded ahead" in staged.kv_note, staged.kv_note
        # It decodes on after the base export (up to its hold, should this client have been
        # slow enough that the export found it there).
        while len(got) < min(base.generated + 4, hold):
            got.append((await call.read()).token)
        await a.Pause(worker_pb2.WorkerPauseRequest())
        delta = await a.ExportSession(
            worker_pb2.ExportSessionRequest(
                session_id="pre", with_kv=True, release=True, from_token=base.tokens
            )
        )
        assert delta.delta and not delta.kv_included
        assert len(got) <= delta.generated
        # It decoded on after the base export, unless that export found it at its hold.
        assert delta.generated > base.generated or base.generated >= hold
        assert len(stored(fleet)) == 1  # the base's folder: the delta wrote none
        imported = await b.ImportSession(
            worker_pb2.ImportSessionRequest(blob=delta.blob, delta_for="pre")
        )
        assert stored(fleet) == []  # loaded: the base's folder is gone
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (more := await call.read()) != grpc.aio.EOF:
                got.append(more.token)
        assert ended.value.code() == grpc.StatusCode.ABORTED  # "moved"
        assert len(got) == delta.generated  # every token up to the move, then the end
        stream = b.Generate(
            worker_pb2.GenerateRequest(resume_session_id="pre", resume_from_token=len(got))
        )
        got += [m.token async for m in stream]
        await a.Resume(worker_pb2.WorkerResumeRequest())
    fleet.stop()
    assert imported.kv_restored, imported.kv_note
    found = re.search(r"(\d+) of (\d+) context tokens loaded", imported.kv_note)
    assert found is not None, imported.kv_note
    loaded, context = int(found.group(1)), int(found.group(2))
    assert loaded == (base.tokens - 1) // BLOCK * BLOCK > 0, imported.kv_note
    assert "while the session was staged" in imported.kv_note, imported.kv_note
    assert context == delta.tokens >= base.tokens  # the tokens after the base were computed
    (alone,) = vllm_alone_runs(vllm_python, vllm_model, [run(toks, n)], tmp_path)
    assert got == alone
