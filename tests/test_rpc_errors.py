"""Refusals from another FleetShift process, as a real gRPC call delivers them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from fleetshift_common.errors import FailedPrecondition, NotFound, Unavailable
from fleetshift_rpc.errors import peer_error, rpc_errors, status_for

METHOD = "/test.Refuser/Refuse"


class Refuser(grpc.GenericRpcHandler):
    """Answers every call with the status code named in the request bytes."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(grpc.StatusCode[request.decode()], "worker w1 has no session s9")

        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture
async def call() -> AsyncIterator:  # type: ignore[type-arg]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Refuser(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        refuse = ch.unary_unary(METHOD)

        async def refused_with(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refuse(code.name.encode())
            return err.value

        yield refused_with
    await server.stop(0)


PASSES = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.NOT_FOUND, NotFound),  # passes with its meaning
        (grpc.StatusCode.DEADLINE_EXCEEDED, Unavailable),  # no answer in time: try again
        (grpc.StatusCode.UNAUTHENTICATED, FailedPrecondition),  # not the caller's credentials
        (grpc.StatusCode.INTERNAL, FailedPrecondition),
    ],
)
async def test_a_peer_refusal_keeps_its_meaning_only_where_it_passes(
    call, code: grpc.StatusCode, expected: type
) -> None:  # type: ignore[no-untyped-def]
    err = peer_error(
        await call(code), "agent of node 'h100-a'", passes=PASSES, default=FailedPrecondition
    )
    assert type(err) is expected
    assert err.message == "agent of node 'h100-a': worker w1 has no session s9"
    if code is grpc.StatusCode.NOT_FOUND:
        assert status_for(err) is code  # and maps back to the status it came as


class Failing:
    """Servicer methods of both shapes that fail as the request bytes say, under rpc_errors."""

    @rpc_errors
    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        fail(request)
        return b"ok"

    @rpc_errors
    async def streaming(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            fail(request)
            yield b"ok"


def fail(request: bytes) -> None:
    if request == b"typed":
        raise NotFound("worker w1 has no session s9", field="session_id")
    if request == b"bug":
        raise RuntimeError("secret internals")


class FailingHandlers(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.servicer = Failing()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.endswith("/Unary"):
            return grpc.unary_unary_rpc_method_handler(self.servicer.unary)
        return grpc.stream_stream_rpc_method_handler(self.servicer.streaming)


@pytest.mark.parametrize(
    ("sent", "code", "said"),
    [
        (b"typed", grpc.StatusCode.NOT_FOUND, "worker w1 has no session s9"),
        (b"bug", grpc.StatusCode.INTERNAL, "internal error in "),
    ],
)
async def test_rpc_errors_answers_unary_and_streaming_methods_alike(
    sent: bytes, code: grpc.StatusCode, said: str
) -> None:
    """A typed error becomes its status, a bug INTERNAL without its text; a streaming method
    (HeartbeatStream) answers what came before and ends its call the same way."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((FailingHandlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await ch.unary_unary("/test.Failing/Unary")(sent)
            call = ch.stream_stream("/test.Failing/Streaming")()
            await call.write(b"fine")
            assert await call.read() == b"ok"
            await call.write(sent)
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await call.read()
    finally:
        await server.stop(0)
    for err in (unary.value, streamed.value):
        assert err.code() == code
        assert said in (err.details() or "")
        assert "secret internals" not in (err.details() or "")
