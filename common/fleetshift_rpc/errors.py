"""The one catalogue that turns FleetShift's typed errors into gRPC statuses.

Servicers stay thin: they convert messages and call the core; whatever the core raises is
mapped here, identically for the daemon and the agent, with the message naming the field.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any, TypeVar, cast

import grpc

from fleetshift_common.errors import (
    Aborted,
    AlreadyExists,
    ErrorKind,
    FailedPrecondition,
    FleetShiftError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

log = logging.getLogger("fleetshift.rpc")

STATUS_FOR_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.ABORTED: grpc.StatusCode.ABORTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def status_for(error: FleetShiftError) -> grpc.StatusCode:
    return STATUS_FOR_KIND[error.kind]


_TYPED = (
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    Unauthenticated,
    PermissionDenied,
    Unavailable,
    Aborted,
)
ERROR_FOR_STATUS: dict[grpc.StatusCode, type[FleetShiftError]] = {
    STATUS_FOR_KIND[cls.kind]: cls for cls in _TYPED
}
ERROR_FOR_STATUS[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable  # no answer in time: retry


def peer_error(
    err: grpc.aio.AioRpcError,
    peer: str,
    *,
    passes: Collection[grpc.StatusCode],
    default: type[FleetShiftError],
    field: str | None = None,
) -> FleetShiftError:
    """Another FleetShift process's refusal, re-raised as the typed error it stands for.

    Only the codes in ``passes`` keep their meaning for our own caller; any other becomes
    ``default`` (the daemon being refused by an agent's TLS is not the operator's
    UNAUTHENTICATED). The message names the peer and keeps its details.
    """
    code = err.code()
    cls = ERROR_FOR_STATUS.get(code, default) if code in passes else default
    return cls(f"{peer}: {err.details()}", field=field)


F = TypeVar("F", bound=Callable[..., Awaitable[Any] | AsyncIterator[Any]])


def rpc_errors(method: F) -> F:
    """Wrap a grpc.aio servicer method, unary or streaming answers (an async generator): typed
    errors become their status, anything unexpected becomes INTERNAL (logged with its
    traceback, never leaked to the caller). A streaming method's error ends its call."""
    if inspect.isasyncgenfunction(method):
        return _streaming_rpc_errors(method)  # type: ignore[return-value]
    unary = cast(Callable[..., Awaitable[Any]], method)

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await unary(self, request, context)
        except Exception as err:  # _abort_for lets AbortError through
            await _abort_for(err, method, context)

    return wrapper  # type: ignore[return-value]


def _streaming_rpc_errors(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def wrapper(
        self: Any, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            async for item in method(self, request, context):
                yield item
        except Exception as err:  # _abort_for lets AbortError through
            await _abort_for(err, method, context)

    return wrapper


async def _abort_for(
    err: Exception, method: Callable[..., Any], context: grpc.aio.ServicerContext
) -> None:
    if isinstance(err, grpc.aio.AbortError):
        raise err
    if isinstance(err, FleetShiftError):
        await context.abort(status_for(err), err.message)
    log.exception("unexpected error in %s", method.__qualname__, exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}")
