"""OpenAI-style error bodies, and the HTTP status each failure maps to.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the status an
OpenAI client expects (its SDK raises ``BadRequestError`` on 400, ``NotFoundError`` on 404,
``RateLimitError`` on 429 and retries 429/503), never a stack trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def cause(self) -> str:
        """The error's label in the metrics: its code, or its status."""
        return self.code or str(self.status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_rpc(err: grpc.aio.AioRpcError, model: str, routed: bool = False) -> ApiError:
    """What a daemon or worker refusal means to the HTTP client. ``routed``: the request's
    route was known, so an unreachable peer is its worker (or a re-route after the worker
    failed), not the daemon the client would otherwise be told to wait for."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(
            429,
            f"rate limited by the fleet: {details}",
            code="rate_limited",
            headers={"Retry-After": str(_retry_after_s(err))},
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # The gateway's own credentials are wrong: no client can fix that by retrying.
        return ApiError(
            502,
            f"the FleetShift daemon refused the gateway ({code.name}): {details}; check the "
            "gateway's --daemon-ca/--daemon-cert/--daemon-key",
            code="upstream_refused",
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, details, code="invalid_value")
    # The gateway already knows the model (404 otherwise): a daemon NOT_FOUND here means no
    # worker serves it right now, which is a capacity problem, not a bad request.
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return ApiError(503, f"no capacity for model {model!r}: {details}", code="no_capacity")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and routed:
        return ApiError(
            503,
            "the request was routed, but its worker and every re-route failed before a token "
            f"(the worker stopped or unreachable, or the daemon gone meanwhile): {details}",
            code="worker_unavailable",
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ApiError(503, f"the FleetShift daemon is unavailable: {details}", code="unavailable")
    return ApiError(500, f"upstream error {code.name}: {details}", code="upstream_error")


def _retry_after_s(err: grpc.aio.AioRpcError) -> int:
    """Whole seconds (HTTP's Retry-After unit), rounded up from the daemon's millisecond hint."""
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after-ms":
            return max(1, -(-int(value) // 1000))
    return 1
