"""Refusals from another FleetShift process, as a real gRPC call delivers them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from fleetshift_common.errors import FailedPrecondition, NotFound, Unavailable
from fleetshift_rpc.errors import peer_error, status_for

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
