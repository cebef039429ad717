"""The boundary check every request passes before a servicer sees it.

One interceptor, installed by ``fleetshift_rpc.server.start_server`` on every server (daemon,
agent, worker), so no service can forget it:

- bytes that do not decode as the method's request message are refused with INVALID_ARGUMENT
  and a plain sentence (grpc itself would answer UNKNOWN naming a Python class);
- every number, enum, string and repeated field of the decoded request (nested messages
  included) is checked against ``fleetshift_common.bounds``: INVALID_ARGUMENT naming the field
  path (``gpus[1].memory_bytes``) and its bound, before anything is read or changed.

The walk is driven by the message descriptors, so a field added to a ``.proto`` is checked as
soon as it has a bound (and ``tests/test_api_bounds.py`` fails until it has one). Rules that
need state (a model's context length, whether a node exists) stay with the services.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from fleetshift_common.bounds import (
    BOUNDS,
    MAX_ITEMS,
    MAX_REPEATED,
    MAX_TEXT,
    MAX_TEXT_CHARS,
    Bound,
    check,
    check_items,
    check_text,
)
from fleetshift_common.errors import InvalidArgument

_NUMERIC = frozenset(
    {
        FieldDescriptor.TYPE_DOUBLE,
        FieldDescriptor.TYPE_FLOAT,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_FIXED32,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
    }
)
# Checksums and other opaque numbers: any value is meaningful.
_OPAQUE = frozenset({FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64})


def is_bounded_number(field: FieldDescriptor) -> bool:
    """Whether ``field`` is a number whose value the bounds table must cover."""
    return field.type in _NUMERIC and field.type not in _OPAQUE and field.enum_type is None


def check_request(message: Message, prefix: str = "") -> None:
    """Raise InvalidArgument for the first field of ``message`` outside its bound."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if field.is_repeated:
            _check_count(field, path, len(value))
            for i, item in enumerate(value):
                _check_value(field, f"{path}[{i}]", item)
        else:
            _check_value(field, path, value)


def _check_count(field: FieldDescriptor, path: str, count: int) -> None:
    bound = BOUNDS.get(field.full_name)
    limit = MAX_REPEATED.get(field.full_name, bound.max_items if bound else MAX_ITEMS)
    check_items(path, count, limit)


def _check_value(field: FieldDescriptor, path: str, value: Any) -> None:
    if field.message_type is not None:
        if not field.message_type.full_name.startswith("google.protobuf."):
            check_request(value, f"{path}.")
        return
    if field.enum_type is not None:
        if field.enum_type.values_by_number.get(value) is None:
            names = ", ".join(v.name for v in field.enum_type.values if v.number != 0)
            raise InvalidArgument(f"{path} must be one of {names}, got {value}", field=field.name)
        return
    if field.type == FieldDescriptor.TYPE_STRING:
        check_text(path, value, MAX_TEXT.get(field.full_name, MAX_TEXT_CHARS))
        return
    if is_bounded_number(field):
        bound: Bound | None = BOUNDS.get(field.full_name)
        if bound is None:  # fail closed: a number nobody bounded is refused, never trusted
            raise InvalidArgument(f"{path} has no documented bound", field=field.name)
        check(path, value, bound)


class _Undecodable:
    """What the tolerant deserializer hands on when the bytes are not the request message."""

    def __init__(self, name: str, problem: str) -> None:
        self.message = f"the request is not a valid {name} message ({problem})"


def _tolerant(deserialize: Callable[[bytes], Any], name: str) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as err:
            return _Undecodable(name, str(err) or "undecodable bytes")

    return parse


def _refusal(request: Any) -> str | None:
    if isinstance(request, _Undecodable):
        return request.message
    if isinstance(request, Message):
        try:
            check_request(request)
        except InvalidArgument as err:
            return err.message
    return None


class RequestBounds(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Decode errors and out-of-bound fields become INVALID_ARGUMENT before the servicer."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name = handler_call_details.method.rpartition("/")[2] + "'s request"
        if handler.request_streaming:
            if not handler.response_streaming or handler.stream_stream is None:
                return handler
            # A stream's messages are decoded as the servicer reads them; one that does not
            # decode ends the stream as INVALID_ARGUMENT. Bounds stay the servicer's: it
            # answers a bad request on the stream and goes on (RouteStream).
            return handler._replace(
                request_deserializer=_tolerant(handler.request_deserializer, name),
                stream_stream=_guard_decoding(handler.stream_stream),
            )
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return handler._replace(
            request_deserializer=_tolerant(handler.request_deserializer, name),
            **{kind: _guard(getattr(handler, kind))},
        )


def _guard_decoding(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def streaming(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def decoded() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                yield request

        async for item in behavior(decoded(), context):
            yield item

    return streaming


def _guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            refusal = _refusal(request)
            if refusal is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
            async for item in behavior(request, context):
                yield item

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        refusal = _refusal(request)
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary
