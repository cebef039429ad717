"""The one catalogue that turns FleetShift's typed errors into gRPC statuses.

Servicers stay thin: they convert messages and call the core; whatever the core raises is
mapped here, identically for the daemon and the agent, with the message naming the field.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

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


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def rpc_errors(method: F) -> F:
    """Wrap a unary grpc.aio servicer method: typed errors become their status, anything
    unexpected becomes INTERNAL (logged with its traceback, never leaked to the caller)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except FleetShiftError as err:
            await context.abort(status_for(err), err.message)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unexpected error in %s", method.__qualname__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}")

    return wrapper  # type: ignore[return-value]
