"""Typed errors shared by the daemon and the agent.

The core raises these without knowing about gRPC; the transport layer maps each ``kind`` to a
status code in one catalogue, so every RPC reports the same failure the same way and the
message always names the offending field.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    FAILED_PRECONDITION = "failed_precondition"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    UNAVAILABLE = "unavailable"
    ABORTED = "aborted"
    INTERNAL = "internal"


class FleetShiftError(Exception):
    """Base of every error FleetShift reports to a caller."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class InvalidArgument(FleetShiftError):
    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(FleetShiftError):
    kind = ErrorKind.NOT_FOUND


class AlreadyExists(FleetShiftError):
    kind = ErrorKind.ALREADY_EXISTS


class FailedPrecondition(FleetShiftError):
    kind = ErrorKind.FAILED_PRECONDITION


class ResourceExhausted(FleetShiftError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class Unauthenticated(FleetShiftError):
    kind = ErrorKind.UNAUTHENTICATED


class PermissionDenied(FleetShiftError):
    kind = ErrorKind.PERMISSION_DENIED


class Unavailable(FleetShiftError):
    kind = ErrorKind.UNAVAILABLE


class Aborted(FleetShiftError):
    kind = ErrorKind.ABORTED
