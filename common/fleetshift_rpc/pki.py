"""A small certificate authority for test fleets, demos and first installs.

A node's name must be bound to something it cannot forge, or any agent could heartbeat as any
other: the certificate carries the identity (CN = name, SAN URI ``fleetshift://<kind>/<name>``)
and the mTLS handshake proves the private key. Keys are ECDSA P-256 (small, fast to verify,
accepted by every TLS stack gRPC uses) and leaves are short-lived so a stolen key stops working
on its own. A real fleet plugs in its own PKI (Vault, cert-manager, an enterprise CA): all the
daemon and the agent need is a CA bundle and a cert/key pair whose URI SAN follows the scheme
in ``fleetshift_rpc.security``.

The CLI (``fleetshift certs ...``) is ``main(argv)``.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetshift_common.errors import AlreadyExists, InvalidArgument, NotFound
from fleetshift_rpc.security import hash_token

URI_SCHEME = "fleetshift"
KINDS = ("node", "operator", "daemon", "router")
CLIENT_ONLY = ("operator", "router")
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
DEFAULT_CA_DAYS = 365
DEFAULT_LEAF_DAYS = 30
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class PkiError(InvalidArgument):
    """A certificate cannot be issued as asked; the message names the argument."""


@dataclass(frozen=True)
class IssuedPair:
    """Where an issued certificate and its private key were written."""

    cert: Path
    key: Path


def identity_uri(kind: str, name: str) -> str:
    return f"{URI_SCHEME}://{kind}/{name}"


def _check_name(name: str) -> None:
    if not name or len(name) > 63 or not set(name) <= _NAME_CHARS:
        raise PkiError(
            f"name {name!r} must be 1-63 characters of letters, digits, '-', '_' or '.'",
            field="name",
        )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes) -> None:
    """Write a key readable by its owner only, atomically (never a world-readable moment)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def init_ca(
    directory: str | Path, common_name: str = "FleetShift CA", days: int = DEFAULT_CA_DAYS
) -> IssuedPair:
    """Create ``ca.crt`` and ``ca.key`` in ``directory``; refuses to replace an existing CA
    (every certificate it signed would silently stop verifying)."""
    if days <= 0:
        raise PkiError(f"days must be > 0, got {days}", field="days")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    pair = IssuedPair(target / CA_CERT, target / CA_KEY)
    if pair.cert.exists() or pair.key.exists():
        raise AlreadyExists(f"a CA already exists in {target}", field="directory")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(pair.key, _key_pem(key))
    _write_public(pair.cert, _cert_pem(cert))
    return pair


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    except FileNotFoundError:
        raise NotFound(
            f"no CA in {directory} (run `fleetshift certs init-ca {directory}`)",
            field="directory",
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{directory / CA_KEY} is not an ECDSA key", field="directory")
    return cert, key


def issue(
    directory: str | Path,
    kind: str,
    name: str,
    *,
    san_ips: Sequence[str] = (),
    san_dns: Sequence[str] = (),
    days: int = DEFAULT_LEAF_DAYS,
) -> IssuedPair:
    """Issue ``<kind>-<name>.crt/.key`` signed by the CA in ``directory``.

    Node and daemon certificates are usable both as TLS client and server (an agent serves
    AgentService; the daemon dials agents), so they carry both extended key usages and the
    ``san_ips``/``san_dns`` the peer dials. Operator and router certificates are client-only.
    """
    if kind not in KINDS:
        raise PkiError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}", field="kind")
    _check_name(name)
    if days <= 0:
        raise PkiError(f"days must be > 0, got {days}", field="days")
    target = Path(directory)
    ca_cert, ca_key = _load_ca(target)
    alt_names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(kind, name))]
    try:
        alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in san_ips]
    except ValueError as err:
        raise PkiError(f"san_ip: {err}", field="san_ip") from None
    alt_names += [x509.DNSName(d) for d in san_dns]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if kind not in CLIENT_ONLY:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, kind),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    pair = IssuedPair(target / f"{kind}-{name}.crt", target / f"{kind}-{name}.key")
    _write_private(pair.key, _key_pem(key))
    _write_public(pair.cert, _cert_pem(cert))
    return pair


def new_token(tokens_file: str | Path, operator: str) -> str:
    """Create a random operator token, append ``<operator> sha256:<hex>`` to ``tokens_file``
    (created 0600) and return the token itself: it is shown once and stored nowhere."""
    _check_name(operator)
    token = secrets.token_urlsafe(32)
    path = Path(tokens_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as out:
        out.write(f"{operator} {hash_token(token)}\n")
    return token


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetshift certs",
        description="Issue a CA and node/operator/daemon certificates for a FleetShift fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ca = sub.add_parser("init-ca", help="create ca.crt and ca.key in DIR")
    ca.add_argument("dir")
    ca.add_argument("--days", type=int, default=DEFAULT_CA_DAYS)
    ca.add_argument("--cn", default="FleetShift CA")
    for command, kind in (
        ("issue-node", "node"),
        ("issue-server", "daemon"),
        ("issue-operator", "operator"),
        ("issue-router", "router"),
    ):
        leaf = sub.add_parser(command, help=f"issue a {kind} certificate signed by DIR's CA")
        leaf.add_argument("dir")
        leaf.add_argument("name")
        leaf.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS)
        leaf.set_defaults(kind=kind)
        if kind not in CLIENT_ONLY:
            leaf.add_argument("--san-ip", action="append", default=[], metavar="IP")
            leaf.add_argument("--san-dns", action="append", default=[], metavar="NAME")
    token = sub.add_parser("new-token", help="create an operator bearer token (printed once)")
    token.add_argument("tokens_file")
    token.add_argument("operator")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "init-ca":
            pair = init_ca(args.dir, args.cn, args.days)
        elif args.command == "new-token":
            print(new_token(args.tokens_file, args.operator))
            return 0
        else:
            pair = issue(
                args.dir,
                args.kind,
                args.name,
                san_ips=getattr(args, "san_ip", ()),
                san_dns=getattr(args, "san_dns", ()),
                days=args.days,
            )
    except (InvalidArgument, AlreadyExists, NotFound) as err:
        print(f"fleetshift certs: {err}", file=sys.stderr)
        return 2
    print(f"wrote {pair.cert} and {pair.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
