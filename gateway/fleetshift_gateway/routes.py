"""Route answers reused for a moment, while the daemon still counts every request.

A Route call used to stand between each request's arrival and its first token: a gRPC round
trip to the daemon, ~2 ms p50 on the loaded development machine, the whole of the gateway's
2 ms TTFT budget. The daemon's answer for a request of a given model and shape changes only
when its view of the fleet does (load counters arrive with heartbeats, every 2 s by default; a
worker starts, drains, moves), so a request of the same model and about the same shape (its
prompt and its stated output each within the same power of two) may start on the answer the
daemon gave a moment ago.

The traffic mix still counts every request, exactly once: a request served from a kept answer
sends its own counted Route call once its first token is out, off the path to that token, and
that call's answer replaces the kept one (so requests in a row still spread over the workers
the daemon samples). The last token of a stream waits for that count, so once a client holds
its whole answer the daemon has counted it, as it did before.

A stale answer costs little: a worker that drains, moves or went away refuses a new session
(UNAVAILABLE) and the request is routed again as before (marked ``reroute``: not counted a
second time). A counting call that fails (the daemon down, rate limiting) drops the model's
kept answers, so the next request waits for its own Route and meets the refusal with its HTTP
status. When counting calls pile up (the daemon slower than the arrivals), requests wait for
their own Route again, so the gateway never holds more than ``max_pending`` of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fleetshift.v1 import placement_pb2
from fleetshift_rpc.route_stream import route_client

log = logging.getLogger("fleetshift.gateway")
ROUTE_TIMEOUT_S = 5.0
# A quarter of the agents' default heartbeat interval (2 s): an answer younger than this was
# computed from the same load counters a fresh one would read, in most cases. Chosen from the
# heartbeat period, not from a benchmark.
DEFAULT_ROUTE_CACHE_S = 0.5
Key = tuple[str, int, int]


def shape_key(route: placement_pb2.RouteRequest) -> Key:
    """Model, and the power-of-two classes of the prompt and of the stated output (0: not
    stated, the daemon estimates it): requests the router would score alike."""
    out = route.expected_output_tokens if route.HasField("expected_output_tokens") else 0
    return route.model, int(route.prompt_tokens).bit_length(), int(out).bit_length()


@dataclass
class _Kept:
    answer: placement_pb2.RouteResponse
    at: float


@dataclass
class Routed:
    """Where a request goes, and the counted Route call still owed for it (None: the answer
    came from its own counted call)."""

    answer: placement_pb2.RouteResponse
    owed: placement_pb2.RouteRequest | None = None


@dataclass
class Router:
    """The gateway's Route calls to the daemon, with answers kept ``ttl_s`` (0: none kept,
    every request waits for its own Route)."""

    daemon: grpc.aio.Channel
    ttl_s: float = DEFAULT_ROUTE_CACHE_S
    max_pending: int = 256
    clock: Callable[[], float] = time.monotonic
    on_answer: Callable[[str], None] = lambda _source: None  # "daemon", "kept", "count_failed"
    _kept: dict[Key, _Kept] = field(default_factory=dict)
    _pending: set[asyncio.Task[None]] = field(default_factory=set)

    async def route(self, route: placement_pb2.RouteRequest) -> Routed:
        """Where ``route`` (not marked reroute) goes; counted now, or owed (``count``)."""
        key = shape_key(route)
        kept = self._kept.get(key)
        if (
            kept is not None
            and self.clock() - kept.at < self.ttl_s
            and len(self._pending) < self.max_pending
        ):
            self.on_answer("kept")
            owed = placement_pb2.RouteRequest()
            owed.CopyFrom(route)
            return Routed(kept.answer, owed)
        answer = await route_client(self.daemon).route(route, timeout=ROUTE_TIMEOUT_S)
        self.on_answer("daemon")
        self._keep(key, answer)
        return Routed(answer)

    def count(self, owed: placement_pb2.RouteRequest) -> asyncio.Task[None]:
        """Send a request's owed, counted Route call in the background; its answer is kept."""
        task = asyncio.get_running_loop().create_task(self._count(owed))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def close(self) -> None:
        """Wait for the counts still in flight (a gateway stopping still reports them)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=ROUTE_TIMEOUT_S)

    def _keep(self, key: Key, answer: placement_pb2.RouteResponse) -> None:
        if self.ttl_s > 0:
            self._kept[key] = _Kept(answer, self.clock())

    async def _count(self, owed: placement_pb2.RouteRequest) -> None:
        try:
            answer = await route_client(self.daemon).route(owed, timeout=ROUTE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            self.on_answer("count_failed")
            for key in [k for k in self._kept if k[0] == owed.model]:
                del self._kept[key]
            log.warning(
                "a counted Route call for model %s failed (%s: %s): its kept answers dropped",
                owed.model,
                err.code().name,
                err.details(),
            )
            return
        self._keep(shape_key(owed), answer)
