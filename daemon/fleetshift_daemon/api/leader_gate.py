"""Operator calls that change the fleet reach the leader, whichever replica the caller dialled.

A follower serves reads (Route, LocateSession, listings, operations) from its own view, but a
call that changes the fleet (every ``OPERATOR_WRITE`` method of ``fleetshift_rpc.auth``) must
run where the executor runs. On a follower this interceptor:

- on a plaintext loopback deployment, forwards the call to the leader as raw bytes with the
  caller's metadata, and relays the answer or the error unchanged (the caller never notices);
- under TLS, answers FAILED_PRECONDITION naming the leader's address, with the address also in
  the trailing metadata key ``fleetshift-leader``: forwarding would present this daemon's
  certificate to the leader instead of the operator's, and a daemon may not act as operator;
- with no leader (a takeover in progress), answers UNAVAILABLE: retry shortly.

The leader passes every call through untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from fleetshift_daemon.core.leadership import Leadership
from fleetshift_rpc.auth import Access, AuthPolicy
from fleetshift_rpc.replicas import LEADER_KEY

log = logging.getLogger("fleetshift.daemon.replicas")

FORWARD_TIMEOUT_S = 600.0  # when the caller set no deadline (a worker start can take minutes)
_DROPPED = (":", "grpc-", "content-type", "user-agent", "te")


class LeaderGate(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        leadership: Leadership,
        forward: bool,
        max_message_bytes: int,
        policy: AuthPolicy | None = None,
    ) -> None:
        self._leadership = leadership
        self._forward = forward
        self._policy = policy or AuthPolicy()
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.forwarded = 0  # calls this replica relayed to the leader (observability, tests)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        method: str = details.method
        if (
            self._leadership.acting()
            or self._policy.access_for(method) is not Access.OPERATOR_WRITE
        ):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        unary = not handler.request_streaming and not handler.response_streaming
        if self._forward and unary and self._leader():
            return grpc.unary_unary_rpc_method_handler(self._forwarder(method))
        return _refusing(handler, self._refusal)

    def _leader(self) -> str:
        """The leader's address, when another replica holds the lease."""
        ld = self._leadership
        return ld.leader_address if ld.leader_identity not in ("", ld.identity) else ""

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = ch
        return ch

    def _forwarder(self, method: str) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            leader = self._leader()
            if not leader:
                await self._refusal(context)
            metadata = [
                (k, v) for k, v in context.invocation_metadata() or () if not k.startswith(_DROPPED)
            ]
            call: Any = self._channel(leader).unary_unary(method)
            remaining = context.time_remaining()
            timeout = FORWARD_TIMEOUT_S if remaining is None else min(remaining, FORWARD_TIMEOUT_S)
            try:
                reply: bytes = await call(request, metadata=metadata, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                trailing = tuple((m[0], m[1]) for m in err.trailing_metadata() or ())
                await context.abort(err.code(), err.details() or "", trailing_metadata=trailing)
            self.forwarded += 1
            return reply

        return forward

    async def _refusal(self, context: grpc.aio.ServicerContext) -> None:
        leader = self._leader()
        me = self._leadership.address
        if not leader:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no daemon leads right now (daemon {me} follows; a takeover is in progress): "
                "retry in a few seconds",
            )
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"daemon {me} follows; the leader is at {leader}: send calls that change the "
            "fleet there (or list every replica in --daemon)",
            trailing_metadata=((LEADER_KEY, leader),),
        )

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


def _refusing(handler: Any, refuse: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> Any:
    """The method's handler with its behaviour replaced by the refusal (streaming or not)."""
    if handler.response_streaming:

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await refuse(context)
            yield  # pragma: no cover - abort raised

        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        return handler._replace(**{kind: streaming})

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    kind = "stream_unary" if handler.request_streaming else "unary_unary"
    return handler._replace(**{kind: unary})
