"""Dialling a daemon that runs as several replicas: one channel over every address.

A caller given ``"a:1,b:2,c:3"`` gets one gRPC channel whose resolver knows all three
addresses (the ``ipv4:``/``ipv6:`` target syntax of gRPC core), balanced ``round_robin`` so
Route load spreads over the replicas, with gRPC's own retry policy for UNAVAILABLE: a call
that finds its replica dead is sent again, to one that is up, before the caller sees an error.
That is the whole failover a reader needs; calls that change the fleet are forwarded to the
leader by whichever replica they reach (``fleetshift_daemon.api.leader_gate``).

Host names are resolved once, when the channel is made (a replica list names machines that
outlive one channel); a single address is passed through untouched, with gRPC's default
resolution and no retry policy, exactly as before.

**TLS**: one channel verifies every server it reaches against one name. gRPC's own choice for
an ``ipv4:a,b,c`` target is the whole address list, which no certificate names, so every
handshake failed ("Hostname Verification Check failed") and a replica list never worked under
TLS. The name checked is therefore the first replica's host as the caller wrote it (what a
channel to that replica alone would check), or ``tls_name`` when given: **every replica's
certificate must name it** (``fleetshift certs issue-server ... --san-ip`` with every
replica's address, or one ``--san-dns`` name all replicas carry, given as ``tls_name``).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any

import grpc

from fleetshift_common.config import split_addresses

LEADER_KEY = "fleetshift-leader"  # trailing metadata of a follower's "not the leader" answer

SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{}],  # every method
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


def is_replica_list(address: str) -> bool:
    return len(split_addresses(address)) > 1


def daemon_target(address: str) -> str:
    """A gRPC target for one address or a comma-separated list of replicas."""
    parts = split_addresses(address)
    if len(parts) == 1:
        return parts[0]
    resolved = [_resolve(p) for p in parts]
    families = {ipaddress.ip_address(host).version for host, _ in resolved}
    if families == {4}:
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in resolved)
    if families == {6}:
        return "ipv6:" + ",".join(f"[{h}]:{p}" for h, p in resolved)
    raise ValueError(f"replica list {address!r} mixes IPv4 and IPv6 addresses")


def daemon_options(
    address: str, max_message_bytes: int = 4 << 20, tls: bool = False, tls_name: str = ""
) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if is_replica_list(address):
        options += [("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
    name = verified_name(address, tls_name)
    if tls and name:
        options.append(("grpc.ssl_target_name_override", name))
    return options


def verified_name(address: str, tls_name: str = "") -> str:
    """The name TLS checks every replica's certificate against: ``tls_name``, else for a
    replica list the first replica's host as written; "" (gRPC's own choice, the host
    dialled) for a single address."""
    if tls_name:
        return tls_name
    parts = split_addresses(address)
    if len(parts) == 1:
        return ""
    return parts[0].rpartition(":")[0].strip("[]")


def aio_daemon_channel(
    address: str,
    max_message_bytes: int = 4 << 20,
    credentials: grpc.ChannelCredentials | None = None,
    tls_name: str = "",
) -> grpc.aio.Channel:
    target = daemon_target(address)
    options = daemon_options(address, max_message_bytes, credentials is not None, tls_name)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def sync_daemon_channel(
    address: str,
    max_message_bytes: int = 4 << 20,
    credentials: grpc.ChannelCredentials | None = None,
    tls_name: str = "",
) -> grpc.Channel:
    target = daemon_target(address)
    options = daemon_options(address, max_message_bytes, credentials is not None, tls_name)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def leader_hint(err: grpc.RpcError) -> str:
    """The leader's address a follower named in its refusal ("" when it named none)."""
    trailing: Any = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for item in trailing or ():
        if item[0] == LEADER_KEY:
            return str(item[1])
    return ""


def _resolve(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return host, int(port)
    except ValueError:
        info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        return str(info[0][4][0]), int(port)
