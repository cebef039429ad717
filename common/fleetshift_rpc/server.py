"""gRPC server and channel construction shared by the daemon and the agent.

Both servers must look the same to an operator with grpcurl: reflection on, the standard
grpc.health.v1 service, and the same message size limit on both ends of every connection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fleetshift_rpc.replicas import aio_daemon_channel, is_replica_list
from fleetshift_rpc.validation import RequestBounds


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class ServiceBinding:
    """One servicer and how to attach it: its add_*_to_server function and full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)


async def start_server(
    listen: str,
    bindings: Sequence[ServiceBinding],
    max_message_bytes: int,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RunningServer:
    """Start a server on ``listen`` (port 0 picks a free one); health starts NOT_SERVING and
    the caller flips it once everything behind the services is ready.

    Without ``credentials`` the port is plaintext (loopback development only, see
    ``fleetshift_rpc.security.check_plaintext_allowed``)."""
    # RequestBounds runs inside the auth interceptors: an unauthenticated caller learns
    # nothing about the bounds, and no servicer sees an undecodable or out-of-bound request.
    server = grpc.aio.server(
        options=message_options(max_message_bytes),
        interceptors=[*interceptors, RequestBounds()],
    )
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [b.full_name for b in bindings]
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    running = RunningServer(server, port, health_servicer)
    await running.set_serving(False)
    return running


def channel(
    address: str,
    max_message_bytes: int,
    credentials: grpc.ChannelCredentials | None = None,
    reconnect_max_s: float | None = None,
) -> grpc.aio.Channel:
    """``reconnect_max_s`` caps gRPC's own reconnect backoff (up to 120 s by default), which
    otherwise decides, behind the caller's retry loop, when a restarted peer is dialled again."""
    if is_replica_list(address):  # several daemon replicas: one channel that fails over
        return aio_daemon_channel(address, max_message_bytes, credentials)
    options = message_options(max_message_bytes)
    if reconnect_max_s is not None:
        cap_ms = max(100, int(reconnect_max_s * 1000))
        options += [
            ("grpc.initial_reconnect_backoff_ms", min(1000, cap_ms)),
            ("grpc.max_reconnect_backoff_ms", cap_ms),
        ]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
