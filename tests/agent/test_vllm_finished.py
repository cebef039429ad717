"""The vLLM worker reports its finished sessions like the reference worker (both build
WorkerInfo in ``worker/session_core.py``): here with a stand-in for vLLM's HTTP stream, so it
runs without a vLLM install (the vLLM tier, tests/vllm, runs the real server)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fleetshift.v1 import worker_pb2
from fleetshift_agent.vllm_worker.client import Chunk, Completion
from fleetshift_agent.vllm_worker.service import VllmIdentity, VllmWorkerServicer


class ScriptedVllm:
    """Answers every completion with ``tokens`` tokens, ending by ``reason``."""

    def __init__(self, tokens: int, reason: str) -> None:
        self.tokens, self.reason = tokens, reason

    async def stream(self, completion: Completion) -> AsyncIterator[Chunk]:
        for i in range(self.tokens):
            yield Chunk((100 + i,), self.reason if i == self.tokens - 1 else "")


async def finished_after(tokens: int, reason: str) -> list[tuple[str, int, int, str]]:
    servicer = VllmWorkerServicer(
        ScriptedVllm(tokens, reason),  # type: ignore[arg-type]
        VllmIdentity("w0", "tiny", worker_pb2.WorkerCompatKey()),
        "mixed",
    )
    feed = await servicer._start_session(
        worker_pb2.GenerateRequest(session_id="s1", prompt_tokens=[1, 2, 3], max_new_tokens=50)
    )
    while not feed.done:
        await feed.changed()
    info = servicer.info()
    await servicer.close()
    return [
        (f.session_id, f.prompt_tokens, f.output_tokens, f.finish_reason)
        for f in info.finished_sessions
    ]


async def test_a_vllm_session_that_stops_is_reported_with_its_lengths() -> None:
    assert await finished_after(7, "stop") == [("s1", 3, 7, "stop")]


async def test_a_vllm_session_vllm_aborted_is_not_reported() -> None:
    assert await finished_after(4, "abort") == []
