"""The server interceptor: who is calling, may they call this method, and not too often.

Every method is classified in one table (``METHOD_ACCESS``) by who may call it, so adding an
RPC means adding one line here, and a method nobody classified is treated as an operator's
mutating call: forgetting the table locks a method down, never opens it. The interceptor
authenticates (client certificate, else bearer token), rate-limits per caller, authorizes by
the table, then publishes the caller for the servicer (``security.current_principal``), which
makes the one check only it can make: that a node speaks for itself
(``security.require_node_identity``). Every refusal is logged with the method and the peer.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc

from fleetshift_common.config import ConfigError
from fleetshift_rpc.ratelimit import RateLimit, RateLimiter
from fleetshift_rpc.security import (
    Principal,
    PrincipalKind,
    TlsFiles,
    TokenFile,
    TokenVerifier,
    bearer_token,
    check_plaintext_allowed,
    is_loopback_peer,
    parse_callers,
    peer_host,
    peer_principal,
    reset_principal,
    set_principal,
)

log = logging.getLogger("fleetshift.auth")

RETRY_AFTER_KEY = "retry-after-ms"
Context: TypeAlias = grpc.aio.ServicerContext


class Access(enum.Enum):
    PUBLIC = "public"  # health, reflection
    AGENT = "agent"  # a node about itself (the servicer checks which node)
    FLEET = "fleet"  # machine to machine inside the fleet: daemon -> agent, agent -> agent
    FLEET_READ = "fleet-read"  # reading an agent's or a worker's state
    OPERATOR_READ = "operator-read"  # reading the fleet
    OPERATOR_WRITE = "operator-write"  # changing the fleet
    ROUTE = "route"  # the request router's hot path: authenticated, not rate-limited
    # A client's token stream on a worker: only the callers the operator listed
    # (``AuthPolicy.session_callers``, the agent's ``worker_session_callers``).
    SESSION = "session"


_K = PrincipalKind
ALLOWED: Mapping[Access, frozenset[PrincipalKind]] = types.MappingProxyType(
    {
        Access.PUBLIC: frozenset(PrincipalKind),
        Access.AGENT: frozenset({_K.NODE}),
        Access.FLEET: frozenset({_K.NODE, _K.DAEMON}),
        Access.FLEET_READ: frozenset({_K.NODE, _K.DAEMON, _K.OPERATOR}),
        Access.OPERATOR_READ: frozenset({_K.OPERATOR, _K.DAEMON}),
        Access.OPERATOR_WRITE: frozenset({_K.OPERATOR}),
        Access.ROUTE: frozenset({_K.ROUTER, _K.OPERATOR}),
        Access.SESSION: frozenset(),  # by kind nobody: the policy's session_callers decide
    }
)
READ_ONLY = frozenset({Access.FLEET_READ, Access.OPERATOR_READ})

_A = Access
METHOD_ACCESS: Mapping[str, Access] = types.MappingProxyType(
    {
        "/grpc.health.v1.Health/*": _A.PUBLIC,
        "/grpc.reflection.v1alpha.ServerReflection/*": _A.PUBLIC,
        "/grpc.reflection.v1.ServerReflection/*": _A.PUBLIC,
        "/fleetshift.v1.AgentRegistry/RegisterNode": _A.AGENT,
        "/fleetshift.v1.AgentRegistry/Heartbeat": _A.AGENT,
        "/fleetshift.v1.AgentRegistry/HeartbeatStream": _A.AGENT,
        "/fleetshift.v1.FleetOperator/ListNodes": _A.OPERATOR_READ,
        "/fleetshift.v1.FleetOperator/GetNode": _A.OPERATOR_READ,
        "/fleetshift.v1.FleetOperator/CordonNode": _A.OPERATOR_WRITE,
        "/fleetshift.v1.FleetOperator/UncordonNode": _A.OPERATOR_WRITE,
        # every other operator method falls to the default, OPERATOR_WRITE; read-only ones
        # are listed here explicitly.
        "/fleetshift.v1.Placement/Route": _A.ROUTE,
        "/fleetshift.v1.Placement/RouteStream": _A.ROUTE,
        "/fleetshift.v1.Placement/PlaceWorker": _A.ROUTE,
        "/fleetshift.v1.Planning/GetEfficiency": _A.OPERATOR_READ,
        "/fleetshift.v1.Planning/GetTrafficMix": _A.OPERATOR_READ,
        "/fleetshift.v1.Planning/PlanRebalance": _A.OPERATOR_READ,
        "/fleetshift.v1.Planning/ListWorkers": _A.OPERATOR_READ,
        "/fleetshift.v1.Calibration/ListModels": _A.OPERATOR_READ,
        "/fleetshift.v1.Calibration/UploadCalibration": _A.OPERATOR_WRITE,
        "/fleetshift.v1.Operations/GetOperation": _A.OPERATOR_READ,
        "/fleetshift.v1.Operations/ListOperations": _A.OPERATOR_READ,
        "/fleetshift.v1.Operations/WatchOperation": _A.OPERATOR_READ,
        "/fleetshift.v1.Operations/LocateSession": _A.ROUTE,
        "/fleetshift.v1.Operations/StartWorker": _A.OPERATOR_WRITE,
        "/fleetshift.v1.Operations/StopWorker": _A.OPERATOR_WRITE,
        "/fleetshift.v1.Operations/Rebalance": _A.OPERATOR_WRITE,
        "/fleetshift.v1.Operations/Drain": _A.OPERATOR_WRITE,
        "/fleetshift.v1.Operations/MoveWorker": _A.OPERATOR_WRITE,
        "/fleetshift.v1.Operations/CancelOperation": _A.OPERATOR_WRITE,
        "/fleetshift.v1.AgentService/GetAgentInfo": _A.FLEET_READ,
        "/fleetshift.v1.AgentService/StartWorker": _A.FLEET,
        "/fleetshift.v1.AgentService/StopWorker": _A.FLEET,
        "/fleetshift.v1.AgentService/SnapshotWorker": _A.FLEET,
        "/fleetshift.v1.AgentService/FetchSnapshot": _A.FLEET,
        "/fleetshift.v1.SnapshotService/ListSnapshots": _A.FLEET_READ,
        "/fleetshift.v1.SnapshotService/GetSnapshot": _A.FLEET_READ,
        "/fleetshift.v1.SnapshotService/CheckCompatibility": _A.FLEET_READ,
        "/fleetshift.v1.SnapshotService/ReadSnapshot": _A.FLEET,
        "/fleetshift.v1.SnapshotService/DeleteSnapshot": _A.FLEET,
        "/fleetshift.v1.WorkerService/GetCounters": _A.FLEET_READ,
        "/fleetshift.v1.WorkerService/GetInfo": _A.FLEET_READ,
        "/fleetshift.v1.WorkerService/Generate": _A.SESSION,
        "/fleetshift.v1.WorkerService/*": _A.FLEET,
    }
)


@dataclass(frozen=True)
class AuthPolicy:
    read_only_open: bool = False  # anonymous callers may use *_READ methods
    trust_plaintext_loopback: bool = True  # plaintext loopback callers: development, trusted
    method_access: Mapping[str, Access] = field(default_factory=lambda: METHOD_ACCESS)
    default_access: Access = Access.OPERATOR_WRITE
    # Per-caller limits protect the fleet from one runaway client; the router legitimately
    # calls Route thousands of times a second, so its class is exempt.
    unlimited: frozenset[Access] = frozenset({Access.ROUTE, Access.SESSION})
    # On a worker's port: the one node whose certificate is trusted (the worker's own agent).
    # Another node's agent must not pause, export or cancel this node's sessions.
    node_scope: str = ""
    # Who may open and follow sessions (``Access.SESSION``): (kind, name) pairs, name "*" for
    # any certificate of that kind from the fleet CA.
    session_callers: frozenset[tuple[PrincipalKind, str]] = frozenset()

    def access_for(self, method: str) -> Access:
        exact = self.method_access.get(method)
        if exact is not None:
            return exact
        service = method.rpartition("/")[0]
        return self.method_access.get(f"{service}/*", self.default_access)

    def allows(self, access: Access, principal: Principal) -> bool:
        if principal.kind is PrincipalKind.LOOPBACK_DEV:
            return True
        if principal.kind is PrincipalKind.ANONYMOUS:
            return access is Access.PUBLIC or (self.read_only_open and access in READ_ONLY)
        if self.foreign_node(principal):
            return access is Access.PUBLIC
        if access is Access.SESSION:
            return any(
                kind is principal.kind and name in ("*", principal.name)
                for kind, name in self.session_callers
            )
        return principal.kind in ALLOWED[access]

    def foreign_node(self, principal: Principal) -> bool:
        """A node's certificate on a port scoped to another node (a worker of that node)."""
        return bool(
            self.node_scope
            and principal.kind is PrincipalKind.NODE
            and principal.name != self.node_scope
        )


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str
    trailing: tuple[tuple[str, str], ...] = ()


RefusalHook = Callable[[str, grpc.StatusCode], None]


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        policy: AuthPolicy,
        tokens: TokenVerifier | None = None,
        limiter: RateLimiter | None = None,
        on_refused: RefusalHook | None = None,
    ) -> None:
        self._policy = policy
        self._tokens = tokens
        self._limiter = limiter
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        method: str = handler_call_details.method
        kind = _handler_kind(handler)
        behavior = self._wrap(getattr(handler, kind), method, handler.request_streaming)
        return handler._replace(**{kind: behavior})

    # --- deciding -----------------------------------------------------------------------------

    def identify(self, context: grpc.aio.ServicerContext) -> tuple[Principal, bool]:
        """The caller, and whether it presented a bearer token that matched nothing."""
        principal = peer_principal(context)
        if (
            principal.via == "plaintext"
            and self._policy.trust_plaintext_loopback
            and is_loopback_peer(principal.peer)
        ):
            principal = Principal(PrincipalKind.LOOPBACK_DEV, "", "plaintext", principal.peer)
        token = bearer_token(context.invocation_metadata())
        if token is None:
            return principal, False
        if principal.via == "certificate":
            # The documented rule is "client certificate, else bearer token": a node's
            # certificate plus a leaked operator token must stay a node.
            log.info(
                "bearer token ignored: the caller presented a client certificate",
                extra={"caller": principal.label, "peer": principal.peer},
            )
            return principal, False
        operator = self._tokens.operator_for(token) if (token and self._tokens) else None
        if operator is None:
            return principal, True
        return Principal(PrincipalKind.OPERATOR, operator, "token", principal.peer), False

    def decide(self, method: str, principal: Principal, bad_token: bool) -> Refusal | None:
        access = self._policy.access_for(method)
        refusal = self._authorize(method, access, principal, bad_token)
        # Refused calls always count against the caller (token guessing is a flood too);
        # only authorized calls of an unlimited class skip the bucket.
        if self._limiter is None or (refusal is None and access in self._policy.unlimited):
            return refusal
        return self._over_limit(principal) or refusal

    def _over_limit(self, principal: Principal) -> Refusal | None:
        assert self._limiter is not None
        key = _limit_key(principal)
        decision = self._limiter.check(key)
        if decision.allowed:
            return None
        ms = decision.retry_after_ms
        return Refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"rate limit for {key} exceeded; retry in {ms} ms",
            ((RETRY_AFTER_KEY, str(ms)),),
        )

    async def _metered(
        self, requests: AsyncIterator[Any], method: str, principal: Principal, context: Context
    ) -> AsyncIterator[Any]:
        """A limited caller's stream messages after the first, each counted like a call: a
        stream must not be a way around the bucket (HeartbeatStream is one call for a node's
        every heartbeat). The first was counted when the call was admitted, as ``principal``:
        the caller is identified once per call, not again for its messages."""
        limited = self._limiter is not None and (
            self._policy.access_for(method) not in self._policy.unlimited
        )
        first = True
        async for request in requests:
            if limited and not first:
                refusal = self._over_limit(principal)
                if refusal is not None:
                    await context.abort(
                        refusal.code, refusal.message, trailing_metadata=refusal.trailing
                    )
            first = False
            yield request

    def _authorize(
        self, method: str, access: Access, principal: Principal, bad_token: bool
    ) -> Refusal | None:
        if access is Access.PUBLIC:
            return None
        if bad_token:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED, "bearer token not recognised")
        if self._policy.allows(access, principal):
            return None
        if principal.kind is PrincipalKind.ANONYMOUS:
            return Refusal(
                grpc.StatusCode.UNAUTHENTICATED, _unauthenticated(method, access, principal)
            )
        if self._policy.foreign_node(principal):
            return Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.label} may not call {method}: this worker belongs to node "
                f"'{self._policy.node_scope}' and takes control calls from its own agent "
                "and the daemon only",
            )
        return Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{principal.label} may not call {method} ({access.value})",
        )

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> tuple[Any, Principal]:
        """The principal's context token (to reset when the call ends) and the principal."""
        principal, bad_token = self.identify(context)
        refusal = self.decide(method, principal, bad_token)
        if refusal is not None:
            log.warning(
                "rpc refused: %s",
                refusal.message,
                extra={
                    "method": method,
                    "peer": principal.peer,
                    "caller": principal.label,
                    "via": principal.via,
                    "code": refusal.code.name,
                },
            )
            if self._on_refused is not None:
                self._on_refused(method, refusal.code)
            await context.abort(refusal.code, refusal.message, trailing_metadata=refusal.trailing)
        return set_principal(principal), principal

    # --- wrapping the four handler shapes -----------------------------------------------------

    def _wrap(
        self, behavior: Callable[..., Any], method: str, request_streaming: bool
    ) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
                token, principal = await self._admit(method, context)
                if request_streaming:
                    request = self._metered(request, method, principal, context)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    with contextlib.suppress(ValueError):  # closed from another context
                        reset_principal(token)

            return streaming

        async def unary(request: Any, context: Context) -> Any:
            token, _ = await self._admit(method, context)
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                reset_principal(token)

        return unary


def _unauthenticated(method: str, access: Access, principal: Principal) -> str:
    """What the caller lacks, for the port it reached: a TLS-only port (no client certificate
    asked for) takes bearer tokens only, so suggesting a certificate there would mislead."""
    needs = f"{method} ({access.value}) needs credentials"
    if principal.via == "tls":
        return f"{needs}: this port takes operator tokens, 'authorization: Bearer <token>'"
    if principal.via == "certificate":
        return f"{needs}: the client certificate carries no fleetshift:// identity"
    return f"{needs}: a client certificate or 'authorization: Bearer <token>'"


def _limit_key(principal: Principal) -> str:
    """Who a bucket belongs to: the authenticated name; an anonymous caller's address; for
    loopback development each connection (a whole local fleet shares one address)."""
    if principal.name:
        return principal.label
    if principal.kind is PrincipalKind.LOOPBACK_DEV:
        return f"conn:{principal.peer}"
    return f"addr:{peer_host(principal.peer)}"


def _handler_kind(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


# --- one call for a process's composition root ---------------------------------------------


@dataclass(frozen=True)
class ServerSecurity:
    """What ``start_server`` needs for a process's ports, built and checked from its config."""

    credentials: grpc.ServerCredentials | None  # main port: mTLS, or None = plaintext loopback
    operator_credentials: grpc.ServerCredentials | None  # TLS-only port for token operators
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]
    tls: TlsFiles | None  # also the process's client credentials: tls.channel_credentials()


def server_security(
    *,
    listen: str,
    tls_cert: str = "",
    tls_key: str = "",
    tls_ca: str = "",
    operator_listen: str = "",
    operator_tokens_file: str = "",
    read_only_open: bool = False,
    rate_limit: RateLimit | None = None,
    expect: tuple[PrincipalKind, str] | None = None,
    on_refused: RefusalHook | None = None,
) -> ServerSecurity:
    """Validate the security keys of a process config (ConfigError naming the key) and build
    its credentials and interceptor. ``expect`` is the identity the process's own certificate
    must carry, e.g. ``(PrincipalKind.NODE, node_name)`` for an agent."""
    tls = TlsFiles.from_config(tls_cert, tls_key, tls_ca)
    if tls is None:
        check_plaintext_allowed(listen, "listen")
        if operator_listen:
            raise ConfigError(
                "config key 'operator_listen' needs tls_cert, tls_key and tls_ca "
                "(bearer tokens are never accepted in plaintext)",
                field="operator_listen",
            )
    elif expect is not None:
        tls.check_identity(*expect)
    tokens = TokenFile(operator_tokens_file) if operator_tokens_file else None
    interceptor = AuthInterceptor(
        AuthPolicy(read_only_open=read_only_open),
        tokens,
        RateLimiter(rate_limit or RateLimit()),
        on_refused,
    )
    return ServerSecurity(
        credentials=tls.server_credentials() if tls else None,
        operator_credentials=(
            tls.server_credentials(require_client_cert=False) if tls and operator_listen else None
        ),
        interceptors=(interceptor,),
        tls=tls,
    )


def worker_security(
    *,
    listen: str,
    node_name: str,
    tls: TlsFiles | None,
    session_callers: tuple[str, ...] = (),
) -> ServerSecurity:
    """A worker's port: mTLS with its node's certificate, control calls from the daemon and
    that node's own agent only, sessions from the listed callers; or, without TLS, plaintext
    on loopback (refused elsewhere, and said loudly at start).

    No rate limit: a worker's callers are the fleet's own machines and the router, which
    legitimately opens sessions as fast as clients arrive; the daemon's and the agent's
    limits protect the fleet from a runaway client."""
    if tls is None:
        check_plaintext_allowed(listen, "listen")
    else:
        tls.check_identity(PrincipalKind.NODE, node_name)
    policy = AuthPolicy(node_scope=node_name, session_callers=parse_callers(session_callers))
    return ServerSecurity(
        credentials=tls.server_credentials() if tls else None,
        operator_credentials=None,
        interceptors=(AuthInterceptor(policy),),
        tls=tls,
    )
