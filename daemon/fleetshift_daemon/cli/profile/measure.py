"""Timing one profile point against a running worker, through the worker's public gRPC API.

Only ``WorkerService/GetInfo`` and ``Generate`` are used, so any engine that serves the worker
interface (the reference engine now, vLLM later) is profiled the same way. A point is a batch
of ``batch_size`` sessions sent at once, each with a ``prompt_size``-token prompt and
``token_size`` greedy output tokens; the times are the client's, as a caller sees them:

- ``prompt_time``: from sending the batch until every session has its first token (the
  whole batch's prefill, the reference table's time to first token);
- ``token_time``: one decode step of the whole batch, timed between consecutive tokens while
  *every* session is decoding (after the last first token, before the first session ends),
  so steps that still carried another session's prefill are not counted as decode;
- ``e2e_time``: from sending until the last token.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.cli.profile.grid import Point


@dataclass(frozen=True)
class HostSpeed:
    """How fast the profiler's host ran a short reference matmul and copy around one run.

    A shared host's speed moves under a sweep (other processes come and go, a CPU throttles),
    so one peak measured at the start cannot describe every point; the calibration scales the
    start's peaks by this run's figures against the same probe's at the start.
    """

    matmul_gflops: float  # float32, the probe's mean rate (not its best: the share it got)
    copy_gbps: float  # bytes read + written per second, mean rate


@dataclass(frozen=True)
class Timing:
    point: Point
    prompt_s: float
    token_s: float
    e2e_s: float
    decode_steps_timed: int  # steps inside the all-decoding window
    # Tokens the first session to start had before the last one got its first: how many
    # steps the batch's prefill was spread over (a chunked-prefill engine staggers it).
    stagger_steps: int
    host: HostSpeed | None = None  # the host's speed around this run, where it was probed
    # CPU seconds the worker's process used over the run (a CPU worker on this host): over
    # ``e2e_s``, the share of a core it got while the machine's other processes ran too
    worker_cpu_s: float | None = None


class PointFailed(Exception):
    pass


_REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


async def _one_session(
    stub: worker_pb2_grpc.WorkerServiceStub, prompt: Sequence[int], tokens: int
) -> list[float]:
    """Arrival times (perf_counter) of each generated token."""
    request = worker_pb2.GenerateRequest(
        prompt_tokens=list(prompt),
        max_new_tokens=tokens,
        sampling=worker_pb2.WorkerSampling(temperature=0.0, seed=0),
    )
    arrivals: list[float] = []
    async for _ in stub.Generate(request):
        arrivals.append(time.perf_counter())
    return arrivals


def _prompts(point: Point, vocab: int, rng: random.Random) -> list[list[int]]:
    # Distinct random prompts: no engine can serve one session from another's prefix cache.
    return [
        [rng.randrange(vocab) for _ in range(point.prompt_size)] for _ in range(point.batch_size)
    ]


def timing_from_arrivals(point: Point, sent: float, arrivals: Sequence[Sequence[float]]) -> Timing:
    """Turn each session's token arrival times into the table's three times."""
    short = [len(a) for a in arrivals if len(a) != point.token_size]
    if short:
        raise PointFailed(f"a session ended after {short[0]} of {point.token_size} tokens")
    all_first = max(a[0] for a in arrivals)
    first_end = min(a[-1] for a in arrivals)
    # The session that started last decodes only while every other session does too, up to
    # the moment the first session ends.
    last_started = max(arrivals, key=lambda a: a[0])
    window = [t for t in last_started if all_first <= t <= first_end]
    first_started = min(arrivals, key=lambda a: a[0])
    stagger = sum(1 for t in first_started if t < all_first)
    if len(window) >= 2:
        token_s = (window[-1] - window[0]) / (len(window) - 1)
        steps = len(window) - 1
    else:  # prefill so staggered that no step had every session decoding: see stagger_steps
        token_s = statistics.median((a[-1] - a[0]) / (len(a) - 1) for a in arrivals)
        steps = 0
    end = max(a[-1] for a in arrivals)
    return Timing(point, all_first - sent, token_s, end - sent, steps, stagger)


async def measure_point(
    channel: grpc.aio.Channel, point: Point, vocab: int, rng: random.Random, timeout_s: float
) -> Timing:
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    prompts = _prompts(point, vocab, rng)
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: see lifecycle.wait_or_timeout
            arrivals = await asyncio.gather(
                *(_one_session(stub, p, point.token_size) for p in prompts)
            )
    except TimeoutError:
        raise PointFailed(f"no answer within {timeout_s:.0f} s") from None
    except grpc.aio.AioRpcError as err:
        if err.code() in _REFUSED:  # the caller's identity, not the point: say so as such
            raise
        raise PointFailed(f"{err.code().name}: {err.details()}") from None
    return timing_from_arrivals(point, sent, arrivals)
