"""Sessions move between vLLM workers with their KV over NIXL: no shared store.

What a user sees: with ``kv_connector = "NixlConnector"`` in a model's engine arguments, a
session exported ``with_kv`` from one vLLM worker and imported on another continues there
without recomputing its context, the way vLLM's own prefill/decode disaggregation hands KV
over: the source's vLLM prefills the session's context asking to keep its blocks
(``do_remote_decode``), and the destination's vLLM pulls them over UCX (host buffers on a
CPU node) through the source's side channel when the session's request starts there. Nothing
is written to a file system, so the two workers need not share one. The import says how many
context tokens vLLM loaded (its own external prefix-cache counter): all of them, the partial
last block included, so even a session shorter than one vLLM block travels. Every greedy
stream then equals vLLM alone's tokens.

Worker to worker, as the executor calls them (Pause, ExportSession with KV, ImportSession,
CancelSession on the source, the client re-attaching on the target).

It needs at least 4 cores. NIXL's UCX progress thread busy-polls a core in every vLLM
process that loads it, idle or not (gdb: ``nixlUcxSharedThread::run`` -> ``progressLoop`` ->
``ucp_worker_progress``, ``epoll_wait`` with a zero timeout), beside vLLM's own engine and
API processes: on the 2-core development and CI machines two NIXL workers left the vLLM
servers answering the shim's /metrics reads too late (10 s), and the fleet's calls starved
(twice, 2026-12-05, load average 40-70). The same calls in the same order, without the
daemon and agents, ran on 2 cores in ``bench/vllm_pause.py --connector nixl``
(docs/vllm.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from fleetshift.v1 import worker_pb2
from fleetshift_daemon.localfleet import LocalFleet
from tests.vllm.conftest import NIXL_MODEL, vllm_alone_runs
from tests.vllm.test_vllm_kv_moves import greq, prompt, run
from tests.vllm.test_vllm_workers import worker_pair

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        (os.cpu_count() or 1) < 4,
        reason="each NIXL vLLM worker busy-polls a core (UCX progress thread): 2 cores starve",
    ),
]
TOKENS = 120
# One context longer than a vLLM block (128 tokens on a CPU), one shorter: NIXL moves
# partial blocks too, so the short one's KV travels where the disk connector's would not.
CASES = {"nixl-long": prompt(262, 11), "nixl-short": prompt(40, 12)}


async def test_a_session_moves_with_its_kv_over_nixl(
    fleet: LocalFleet, vllm_python: str, vllm_model: Path, tmp_path: Path
) -> None:
    async with worker_pair(fleet, NIXL_MODEL) as (a, b):
        firsts = {sid: a.Generate(greq(sid, toks, TOKENS, hold=8)) for sid, toks in CASES.items()}
        before: dict[str, list[int]] = {sid: [] for sid in CASES}
        for sid, first in firsts.items():
            for _ in range(8):
                before[sid].append((await first.read()).token)
        await a.Pause(worker_pb2.WorkerPauseRequest())
        notes: dict[str, worker_pb2.ImportSessionResponse] = {}
        for sid, first in firsts.items():
            exp = await a.ExportSession(
                worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True), timeout=120
            )
            assert exp.kv_included and exp.generated == 8
            notes[sid] = await b.ImportSession(
                worker_pb2.ImportSessionRequest(blob=exp.blob), timeout=240
            )
            await a.CancelSession(worker_pb2.CancelSessionRequest(session_id=sid))
            first.cancel()
        after = {}
        for sid in CASES:
            stream = b.Generate(worker_pb2.GenerateRequest(resume_session_id=sid))
            after[sid] = [m.token async for m in stream]
    fleet.stop()
    for note in notes.values():
        assert note.kv_restored, note.kv_note
        assert "NixlConnector" in note.kv_note, note.kv_note
        loaded = re.search(r"(\d+) of (\d+) context tokens loaded", note.kv_note)
        assert loaded is not None, note.kv_note
        assert int(loaded.group(1)) == int(loaded.group(2)) == note.tokens, note.kv_note
    got = {sid: before[sid] + after[sid] for sid in CASES}
    alone = vllm_alone_runs(
        vllm_python, vllm_model, [run(p, TOKENS) for p in CASES.values()], tmp_path
    )
    assert got == dict(zip(CASES, alone, strict=True))
