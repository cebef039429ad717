"""Server-streaming RPCs go through the same checks, and the servicer sees its caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift_rpc.auth import AuthInterceptor, AuthPolicy
from fleetshift_rpc.security import TlsFiles, client_credentials, current_principal
from fleetshift_rpc.server import ServiceBinding, start_server
from tests.security.conftest import Certs

# A FLEET method in the table: nodes and the daemon may call it, operators may not.
METHOD = "/fleetshift.v1.SnapshotService/ReadSnapshot"


async def who_is_calling(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for chunk in range(3):
        principal = current_principal()
        assert principal is not None
        yield f"{chunk}:{principal.label}".encode()


def _add(servicer: object, server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        "fleetshift.v1.SnapshotService",
        {"ReadSnapshot": grpc.unary_stream_rpc_method_handler(who_is_calling)},
    )
    server.add_generic_rpc_handlers((handler,))


async def test_streaming_calls_are_authorized_and_see_their_caller(
    tmp_path: Path, certs: Certs
) -> None:
    files = TlsFiles(str(certs.daemon.cert), str(certs.daemon.key), str(certs.ca))
    binding = ServiceBinding(_add, None, "fleetshift.v1.SnapshotService")
    server = await start_server(
        "127.0.0.1:0",
        [binding],
        1 << 20,
        files.server_credentials(),
        [AuthInterceptor(AuthPolicy())],
    )
    address = f"127.0.0.1:{server.port}"
    try:
        node = client_credentials(str(certs.ca), str(certs.node_b.cert), str(certs.node_b.key))
        async with grpc.aio.secure_channel(address, node) as ch:
            call = ch.unary_stream(METHOD)(b"")
            chunks = [c async for c in call]
        assert chunks == [b"0:node:node-b", b"1:node:node-b", b"2:node:node-b"]

        operator = client_credentials(
            str(certs.ca), str(certs.operator.cert), str(certs.operator.key)
        )
        async with grpc.aio.secure_channel(address, operator) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [c async for c in ch.unary_stream(METHOD)(b"")]
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "operator:alice" in err.value.details()
    finally:
        await server.server.stop(0)
