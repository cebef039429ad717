"""Who is calling: TLS credentials, the caller's identity, and the checks servicers make.

A node's name is only worth something if the caller cannot choose it. Under mTLS the name comes
from the client certificate's URI SAN (``fleetshift://node/<name>``), which the handshake has
already proven against the fleet CA; a servicer then compares it with the ``node_name`` in the
request (``require_node_identity``), so node A's certificate can never register or heartbeat as
node B. The interceptor (``fleetshift_rpc.auth``) establishes the ``Principal`` once per call and
publishes it in a context variable, because grpc.aio interceptors cannot see the deserialized
request of a unary call while servicers can: the split keeps each check where its data is.

Plaintext exists for loopback development only; ``check_plaintext_allowed`` refuses anything
else at start, with the config key named, instead of letting a fleet run unauthenticated.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import hashlib
import hmac
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from cryptography import x509

from fleetshift_common.config import ConfigError
from fleetshift_common.errors import PermissionDenied

log = logging.getLogger("fleetshift.security")

URI_PREFIX = "fleetshift://"


class PrincipalKind(enum.Enum):
    NODE = "node"  # an agent, by its node certificate
    OPERATOR = "operator"  # a person or tool, by operator certificate or bearer token
    DAEMON = "daemon"  # the central daemon dialling agents, by its server certificate
    ROUTER = "router"  # the fleet's request router calling Route, by its certificate
    ANONYMOUS = "anonymous"  # no identity (TLS without client certificate, no token)
    LOOPBACK_DEV = "loopback-dev"  # plaintext on loopback: development, trusted fully


@dataclass(frozen=True)
class Principal:
    kind: PrincipalKind
    name: str
    via: str  # "certificate" | "token" | "plaintext" | "tls" (TLS, no client certificate)
    peer: str  # grpc's peer string, for logs

    @property
    def label(self) -> str:
        return f"{self.kind.value}:{self.name}" if self.name else self.kind.value


CERTIFICATE_KINDS = (
    PrincipalKind.NODE,
    PrincipalKind.OPERATOR,
    PrincipalKind.DAEMON,
    PrincipalKind.ROUTER,
)

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "fleetshift_principal", default=None
)


def current_principal() -> Principal | None:
    """The caller of the RPC being served, or None when no auth interceptor ran."""
    return _principal.get()


def set_principal(principal: Principal) -> contextvars.Token[Principal | None]:
    return _principal.set(principal)


def reset_principal(token: contextvars.Token[Principal | None]) -> None:
    _principal.reset(token)


def require_node_identity(node_name: str) -> Principal:
    """Refuse unless the caller is the node ``node_name`` (or a loopback development client).

    Servicers call it first thing in every RPC an agent makes about itself (RegisterNode,
    Heartbeat, and later ones). It fails closed: with no identity established (the auth
    interceptor is not installed) nothing passes.
    """
    principal = current_principal()
    if principal is None:
        raise PermissionDenied(
            f"no caller identity established for node '{node_name}' "
            "(the auth interceptor is not installed on this server)",
            field="node_name",
        )
    if principal.kind is PrincipalKind.LOOPBACK_DEV:
        return principal
    if principal.kind is not PrincipalKind.NODE:
        raise PermissionDenied(
            f"caller {principal.label} is not a node and cannot act as node '{node_name}'",
            field="node_name",
        )
    if principal.name != node_name:
        log.warning(
            "node identity mismatch refused",
            extra={"caller": principal.label, "claimed": node_name, "peer": principal.peer},
        )
        raise PermissionDenied(
            f"node certificate '{principal.name}' cannot act as node '{node_name}'",
            field="node_name",
        )
    return principal


# --- identity from a certificate ------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def principal_from_pem(pem: bytes) -> tuple[PrincipalKind, str]:
    """The identity a verified peer certificate carries in its ``fleetshift://`` URI SAN.

    A certificate of the right CA without exactly one such URI is anonymous: a role is never
    guessed from a common name alone. Cached because the same few certificates call all day.
    """
    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return PrincipalKind.ANONYMOUS, ""
    uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier)]
    ours = [u[len(URI_PREFIX) :] for u in uris if u.startswith(URI_PREFIX)]
    if len(ours) != 1:
        return PrincipalKind.ANONYMOUS, ""
    kind, _, name = ours[0].partition("/")
    by_value = {k.value: k for k in CERTIFICATE_KINDS}
    if kind not in by_value or not name or "/" in name:
        return PrincipalKind.ANONYMOUS, ""
    return by_value[kind], name


def peer_principal(context: grpc.aio.ServicerContext) -> Principal:
    """Identity of the transport: the client certificate if any, plaintext, or anonymous."""
    auth = context.auth_context() or {}
    peer = context.peer() or ""
    pems = auth.get("x509_pem_cert")
    if pems:
        kind, name = principal_from_pem(bytes(pems[0]))
        # A presented certificate decides, even one without an identity (then anonymous):
        # "client certificate, else bearer token".
        return Principal(kind, name, "certificate", peer)
    if not auth.get("transport_security_type") or auth.get("transport_security_type") == [
        b"insecure"
    ]:
        return Principal(PrincipalKind.ANONYMOUS, "", "plaintext", peer)
    return Principal(PrincipalKind.ANONYMOUS, "", "tls", peer)


def peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5555`` -> ``127.0.0.1``; ``ipv6:[::1]:5555`` -> ``::1``."""
    _, _, rest = peer.partition(":")
    host = rest.rpartition(":")[0] if ":" in rest else rest
    return host.strip("[]") or peer


def is_loopback_peer(peer: str) -> bool:
    if peer.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(peer_host(peer)).is_loopback
    except ValueError:
        return False


# --- operator tokens --------------------------------------------------------------------------


def hash_token(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class OperatorTokens:
    """Operator bearer tokens, stored only as sha256 digests, one ``<operator> sha256:<hex>``
    per line. A presented token is hashed and compared with every stored digest in constant
    time, so neither a match's position nor a near miss shows in the response time."""

    def __init__(self, entries: Mapping[str, str]) -> None:
        # digest -> operator name
        self._entries = [(digest.encode(), name) for digest, name in entries.items()]

    @classmethod
    def parse(cls, lines: Iterable[str], source: str = "tokens") -> OperatorTokens:
        entries: dict[str, str] = {}
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].startswith("sha256:") or len(parts[1]) != 71:
                raise ConfigError(
                    f"{source}:{number}: expected '<operator> sha256:<64 hex digits>'",
                    field="operator_tokens_file",
                )
            entries[parts[1].lower()] = parts[0]
        return cls(entries)

    @classmethod
    def from_file(cls, path: str | Path) -> OperatorTokens:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(
                f"operator tokens file {path} does not exist", field="operator_tokens_file"
            ) from None
        return cls.parse(text.splitlines(), str(path))

    def __len__(self) -> int:
        return len(self._entries)

    def operator_for(self, token: str) -> str | None:
        presented = hash_token(token).encode()
        found: str | None = None
        for digest, name in self._entries:
            if hmac.compare_digest(presented, digest):
                found = name
        return found


class TokenVerifier(Protocol):
    def operator_for(self, token: str) -> str | None: ...


class TokenFile:
    """Operator tokens read from a file and re-read when it changes (checked at most every
    ``check_every_s``), so revoking a leaked token is deleting its line, no restart. A file
    that turns unreadable or malformed accepts no token at all until fixed: fail closed."""

    def __init__(
        self,
        path: str | Path,
        check_every_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = Path(path)
        self._check_every_s = check_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._tokens = OperatorTokens.from_file(self._path)  # a bad file fails the start
        self._checked = clock()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self._path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _refresh(self) -> None:
        now = self._clock()
        with self._lock:
            if now - self._checked < self._check_every_s:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                self._tokens = OperatorTokens.from_file(self._path)
                log.info("operator tokens reloaded", extra={"path": str(self._path)})
            except ConfigError as err:
                self._tokens = OperatorTokens({})
                log.error("operator tokens unusable, refusing all tokens: %s", err)

    def operator_for(self, token: str) -> str | None:
        self._refresh()
        return self._tokens.operator_for(token)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of ``authorization: Bearer <token>``; '' when the header is malformed."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""
    return None


# --- TLS material -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths of this process's certificate, its key and the fleet CA bundle."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_config(cls, cert: str, key: str, ca: str, prefix: str = "tls_") -> TlsFiles | None:
        """None when all three are empty (plaintext); a ConfigError naming the missing key
        when only some are set, or when a file cannot be read."""
        values = {f"{prefix}cert": cert, f"{prefix}key": key, f"{prefix}ca": ca}
        if not any(values.values()):
            return None
        for name, value in values.items():
            if not value:
                raise ConfigError(
                    f"config key '{name}' must be set with {', '.join(values)}", field=name
                )
            if not Path(value).is_file():
                raise ConfigError(f"config key '{name}': no file at {value}", field=name)
        return cls(cert, key, ca)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """mTLS (client certificate required and verified against the CA) by default; without
        it, TLS only: the port on which operators present bearer tokens."""
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)

    def identity(self) -> tuple[PrincipalKind, str]:
        return principal_from_pem(Path(self.cert).read_bytes())

    def check_identity(self, kind: PrincipalKind, name: str, key: str = "tls_cert") -> None:
        """Refuse to start with a certificate that names someone else (an agent configured as
        ``node_name = a`` holding b's certificate would be refused on every call)."""
        got_kind, got_name = self.identity()
        if (got_kind, got_name) != (kind, name):
            raise ConfigError(
                f"config key '{key}': certificate {self.cert} identifies "
                f"{got_kind.value}:{got_name or '?'}, expected {kind.value}:{name}",
                field=key,
            )

    def check_host(self, host: str, key: str) -> None:
        """Refuse to start when peers dialling ``host`` could not verify this certificate:
        every TLS client checks the address it dialled against the certificate's SANs, so a
        node whose workers serve on an address its certificate does not name would start
        fine and then fail every move with a handshake error far from the cause."""
        ips, names = _san_values(Path(self.cert).read_bytes())
        try:
            ok = ipaddress.ip_address(host) in ips
        except ValueError:
            ok = any(_dns_matches(host, name) for name in names)
        if not ok:
            named = ", ".join([*map(str, ips), *names]) or "no address"
            raise ConfigError(
                f"config key '{key}': peers dial {host!r}, which certificate {self.cert} does "
                f"not name (it names {named}); issue it with --san-ip or --san-dns {host}",
                field=key,
            )


def _san_values(
    pem: bytes,
) -> tuple[list[ipaddress.IPv4Address | ipaddress.IPv6Address], list[str]]:
    cert = x509.load_pem_x509_certificate(pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    ips = [
        ip
        for ip in sans.get_values_for_type(x509.IPAddress)
        if not isinstance(ip, ipaddress.IPv4Network | ipaddress.IPv6Network)
    ]
    return ips, list(sans.get_values_for_type(x509.DNSName))


def _dns_matches(host: str, name: str) -> bool:
    """RFC 6125's rule as TLS stacks apply it: exact, or ``*.`` matching one leftmost label."""
    host, name = host.lower().rstrip("."), name.lower().rstrip(".")
    if name.startswith("*."):
        label, _, rest = host.partition(".")
        return bool(label) and rest == name[2:]
    return host == name


def client_credentials(
    ca: str, cert: str = "", key: str = "", token: str = ""
) -> grpc.ChannelCredentials:
    """What an operator tool dials with: the fleet CA, optionally its own certificate (for the
    mTLS port) and optionally a bearer token, sent as ``authorization: Bearer`` on every call
    (gRPC only sends call credentials over TLS, never in plaintext)."""
    if bool(cert) != bool(key):
        raise ConfigError(
            "a client certificate needs its key (and the other way round)", field="key"
        )
    creds = grpc.ssl_channel_credentials(
        Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def parse_callers(
    patterns: Iterable[str], key: str = "worker_session_callers"
) -> frozenset[tuple[PrincipalKind, str]]:
    """``["router:*", "operator:alice"]`` -> {(ROUTER, "*"), (OPERATOR, "alice")}: the
    certificate identities an operator lets open sessions on a node's workers. A pattern of
    an unknown kind, or without a name, stops the process at start with the key named."""
    by_value = {k.value: k for k in CERTIFICATE_KINDS}
    parsed: set[tuple[PrincipalKind, str]] = set()
    for pattern in patterns:
        kind, sep, name = pattern.partition(":")
        if not sep or kind not in by_value or not name or "/" in name:
            raise ConfigError(
                f"config key '{key}': {pattern!r} must be '<kind>:<name>' or '<kind>:*' with "
                f"kind one of {', '.join(by_value)}",
                field=key,
            )
        parsed.add((by_value[kind], name))
    return frozenset(parsed)


def check_plaintext_allowed(listen: str, key: str = "listen") -> None:
    """Plaintext is for loopback development: refuse any other address, warn on loopback."""
    host = listen.rpartition(":")[0].strip("[]")
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ConfigError(
            f"config key '{key}' = {listen!r} is not a loopback address: plaintext gRPC is "
            "allowed on loopback only; set tls_cert, tls_key and tls_ca for anything else",
            field=key,
        )
    log.warning(
        "PLAINTEXT gRPC on %s: no authentication, no encryption; development only",
        listen,
        extra={"listen": listen, "key": key},
    )
