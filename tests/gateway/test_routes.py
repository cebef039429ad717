"""The gateway's kept Route answers against a Placement server over real gRPC: a request of a
shape seen a moment ago starts on the kept answer, and still sends the daemon its own counted
Route call (exactly one per request); answers age out, differ by shape, are dropped when a
counting call fails, and are not kept at all with a TTL of 0 or while counts pile up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from fleetshift_gateway.routes import Router, shape_key

from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc


class Daemon(ppb_grpc.PlacementServicer):
    """Answers worker w0, w1, ... in turn and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[ppb.RouteRequest] = []
        self.refuse: grpc.StatusCode | None = None
        self.gate: asyncio.Event | None = None  # set: answers wait for it

    async def Route(
        self, request: ppb.RouteRequest, context: grpc.aio.ServicerContext
    ) -> ppb.RouteResponse:
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse is not None:
            await context.abort(self.refuse, "no worker serves it")
        self.asked.append(request)
        n = len(self.asked) - 1
        return ppb.RouteResponse(worker_id=f"w{n}", endpoint=f"127.0.0.1:{1000 + n}")

    @property
    def counted(self) -> int:
        return sum(1 for r in self.asked if not r.reroute)


@pytest.fixture
async def daemon() -> AsyncIterator[tuple[Daemon, grpc.aio.Channel]]:
    servicer = Daemon()
    server = grpc.aio.server()
    ppb_grpc.add_PlacementServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield servicer, ch
    await server.stop(None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ask(prompt: int, output: int | None = 64) -> ppb.RouteRequest:
    route = ppb.RouteRequest(model="m", prompt_tokens=prompt)
    if output is not None:
        route.expected_output_tokens = output
    return route


async def test_a_kept_answer_serves_and_the_request_is_still_counted_once(
    daemon: tuple[Daemon, grpc.aio.Channel],
) -> None:
    servicer, ch = daemon
    clock = Clock()
    sources: list[str] = []
    router = Router(ch, ttl_s=0.5, clock=clock, on_answer=sources.append)
    first = await router.route(ask(32))
    assert first.answer.worker_id == "w0" and first.owed is None and servicer.counted == 1
    clock.now += 0.2
    second = await router.route(ask(40))  # same classes: prompt 32-63, output 64-127
    assert second.answer.worker_id == "w0" and second.owed is not None
    assert servicer.counted == 1  # not yet: it is owed, sent after the first token
    await router.count(second.owed)
    assert servicer.counted == 2 and not servicer.asked[-1].reroute
    assert servicer.asked[-1].prompt_tokens == 40  # the request's own shape is counted
    third = await router.route(ask(33))
    assert third.answer.worker_id == "w1"  # the counting call's answer replaced the kept one
    assert sources == ["daemon", "kept", "kept"]


async def test_answers_age_out_and_differ_by_shape(
    daemon: tuple[Daemon, grpc.aio.Channel],
) -> None:
    servicer, ch = daemon
    clock = Clock()
    router = Router(ch, ttl_s=0.5, clock=clock)
    await router.route(ask(32))
    for other in (ask(64), ask(32, 128), ask(32, None)):  # another class of prompt or output
        assert (await router.route(other)).owed is None
    assert servicer.counted == 4
    assert shape_key(ask(32, None)) != shape_key(ask(32, 64))
    clock.now += 0.5
    assert (await router.route(ask(32))).owed is None and servicer.counted == 5


async def test_a_failed_count_drops_the_models_answers_and_the_next_request_sees_it(
    daemon: tuple[Daemon, grpc.aio.Channel],
) -> None:
    servicer, ch = daemon
    sources: list[str] = []
    router = Router(ch, ttl_s=30, clock=Clock(), on_answer=sources.append)
    await router.route(ask(32))
    await router.route(ask(200))
    owed = (await router.route(ask(32))).owed
    assert owed is not None
    servicer.refuse = grpc.StatusCode.NOT_FOUND
    await router.count(owed)
    assert sources[-1] == "count_failed"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await router.route(ask(200))  # the other shape's answer went too
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_no_answer_is_kept_with_ttl_zero_or_while_counts_pile_up(
    daemon: tuple[Daemon, grpc.aio.Channel],
) -> None:
    servicer, ch = daemon
    off = Router(ch, ttl_s=0, clock=Clock())
    for _ in range(3):
        assert (await off.route(ask(32))).owed is None
    assert servicer.counted == 3
    router = Router(ch, ttl_s=30, clock=Clock(), max_pending=2)
    await router.route(ask(32))
    servicer.gate = asyncio.Event()  # the daemon stalls: counts stay in flight
    for _ in range(2):
        owed = (await router.route(ask(32))).owed
        assert owed is not None
        router.count(owed)
    waiting = asyncio.create_task(router.route(ask(32)))  # two pending: asks the daemon itself
    await asyncio.sleep(0.2)
    assert not waiting.done()
    servicer.gate.set()
    assert (await waiting).owed is None
    await router.close()
    assert servicer.counted == 3 + 4  # every request counted exactly once
