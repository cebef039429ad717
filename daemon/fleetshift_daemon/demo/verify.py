"""Checks, not assertions: did every client see each of its tokens exactly once?

Two checks. Every stream: one chunk per token (the gateway's contract), as many chunks as
the usage it reports and as the ``max_tokens`` asked for, ending ``length``. The streams that
were open when a move switched (or all of them, with ``--check all``): the same request
rerun on a worker directly, with nothing moving it (seeded sampling makes the rerun
bit-equal), decoded the same way, equals what the client saw, delta for delta. A token lost
or repeated by a move shows up as a difference there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.demo.replay import TEMPERATURE, TOP_P, StreamRecord
from fleetshift_daemon.demo.watch import Step


@dataclass
class Verdict:
    streams: int = 0
    complete: int = 0  # chunk count == usage == max_tokens
    incomplete: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # requests the fleet refused or ended
    compared: int = 0
    equal: int = 0
    differing: list[str] = field(default_factory=list)
    tokens_lost: int = 0
    tokens_repeated: int = 0
    unchecked: list[str] = field(default_factory=list)  # reruns that failed: no verdict

    @property
    def clean(self) -> bool:
        return not self.incomplete and not self.differing and not self.unchecked


def crossed_a_move(record: StreamRecord, steps: Sequence[Step]) -> bool:
    """The stream was open when a step that can carry sessions (warm or cold move, role
    change, retire) switched them over: the moment a token could be lost or repeated."""
    for s in steps:
        if s.kind == "start" or s.finished is None:
            continue
        if record.sent_at <= s.finished <= record.ended_at:
            return True
    return False


def count_check(records: Sequence[StreamRecord], verdict: Verdict) -> None:
    for r in records:
        verdict.streams += 1
        want = r.request.max_tokens
        got = len(r.texts)
        if r.error:  # refused or ended with an error the client saw: not served, not a loss
            verdict.failed.append(f"request {r.request.index}: after {got} token(s): {r.error}")
        elif got != want or r.usage_tokens != got or r.finish_reason != "length":
            verdict.incomplete.append(
                f"request {r.request.index}: {got} chunks, usage {r.usage_tokens}, asked "
                f"{want}, finish {r.finish_reason}{', ' + r.error if r.error else ''}"
            )
            verdict.tokens_lost += max(0, want - got)
            verdict.tokens_repeated += max(0, got - want)
        else:
            verdict.complete += 1


async def reference_check(
    endpoint: str,
    model_dir: Path,
    records: Sequence[StreamRecord],
    verdict: Verdict,
    concurrency: int = 16,
) -> None:
    """Rerun ``records`` on the worker at ``endpoint`` and compare delta for delta."""
    from fleetshift_gateway.tokenizer import ModelTokenizer  # the gateway's own decoding

    tok = ModelTokenizer.load("reference", model_dir)
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        async def one(r: StreamRecord) -> None:
            req = r.request
            sampling = worker_pb2.WorkerSampling(
                temperature=TEMPERATURE, top_p=TOP_P, seed=req.seed
            )
            ask = worker_pb2.GenerateRequest(
                prompt_tokens=req.prompt,
                max_new_tokens=req.max_tokens,
                sampling=sampling,
                session_id=f"demo-reference-{req.index}",
            )
            async with gate:
                try:
                    ids = [m.token async for m in stub.Generate(ask, timeout=900)]
                except grpc.aio.AioRpcError as err:
                    verdict.unchecked.append(f"request {req.index}: rerun failed: {err.details()}")
                    return
            decoder = tok.stream_decoder()
            expected = [decoder.push(t) for t in ids]
            if expected:
                expected[-1] += decoder.flush()
            verdict.compared += 1
            if expected == r.texts:
                verdict.equal += 1
            else:
                first = next(
                    (i for i, (a, b) in enumerate(zip(expected, r.texts, strict=False)) if a != b),
                    min(len(expected), len(r.texts)),
                )
                verdict.differing.append(
                    f"request {req.index}: differs from the unmoved rerun at token {first} "
                    f"({len(r.texts)} seen, {len(expected)} expected)"
                )

        await asyncio.gather(*(one(r) for r in records))
