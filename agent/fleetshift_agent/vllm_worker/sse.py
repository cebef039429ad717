"""One streaming HTTP/1.1 request to the local vLLM server, read as server-sent events.

Why not httpx here: every token of every session crosses this path, and httpx (through
httpcore, h11 and anyio) runs several layers of async generators, a cancel scope and a
decoder per chunk read: measured, that was about a third of the vLLM worker's CPU per token
(docs/vllm.md, Benchmarks). vLLM's server is on 127.0.0.1, speaks plain HTTP/1.1 and frames a
streaming answer with chunked transfer encoding, one ``data: {json}`` event per chunk, so a
protocol object fed by httptools' C parser is enough: one wake-up of the reading task per
socket read (however many events it carries), no per-chunk objects but the payloads. The
rest of the shim's HTTP (health, metrics, pause) stays on httpx: it is rare.

Each request has its own connection: a session's request lasts for its whole output, and
closing the connection is how vLLM learns a request was abandoned (it aborts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import quote

import httptools

from fleetshift_common.errors import Unavailable

MAX_HEAD_BYTES = 64 << 10  # a response head larger than this is not vLLM's
HEADER_SAFE = "!#$&'()*+,/:;=?@[]^_`{|}~-."  # printable ASCII kept as is (and letters, digits)


class SseProtocol(asyncio.Protocol):
    """Reads one HTTP/1.1 response into SSE payloads. httptools (llhttp, the parser Node.js
    and uvicorn use) does the HTTP framing: status, headers, chunked or length-framed body;
    this class only splits the body into ``data:`` lines and wakes the reader. It runs inside
    the event loop's reads, so parsing each payload's JSON is left to the reader (an error
    there belongs to the session, not to the loop)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.error_body = bytearray()
        self.ended = False
        self.failure = ""
        self._parser = httptools.HttpResponseParser(self)
        self._ready: list[bytes] = []  # payloads not yet taken
        self._line = bytearray()  # the SSE line being assembled from body bytes
        self._head = True
        self._head_bytes = 0
        self._framed = False  # the head gave a length or chunked encoding
        self._waiter: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's does not subclass asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            if self._head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    raise ValueError("response head too large")
            self._parser.feed_data(data)
        except (httptools.HttpParserError, ValueError) as err:
            self._end(f"vLLM's response is not HTTP/1.1 as expected: {err!r}")
            if self.transport is not None:
                self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            # A body with neither a length nor chunks ends with the connection (HTTP/1.1).
            by_close = not self._head and not self._framed and exc is None
            cut = "" if by_close else "vLLM closed the connection before the response ended"
            self._end(cut + _why(exc))
        self._wake()

    # ---- the reader's side ----------------------------------------------------------------

    async def take(self) -> list[bytes]:
        """The payloads that arrived since the last call, waiting for at least one; [] once
        the response has ended (``failure`` says whether it ended well)."""
        while not self._ready and not self.ended:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        ready, self._ready = self._ready, []
        return ready

    async def head(self) -> None:
        """Wait for the status line and headers (or the end of the connection)."""
        while self._head and not self.ended:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    # ---- httptools' callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._head = False

    def on_body(self, data: bytes) -> None:
        if self.status != 200:
            self.error_body += data
            return
        self._line += data
        start = 0
        while True:
            nl = self._line.find(b"\n", start)
            if nl < 0:
                break
            line = bytes(self._line[start:nl]).rstrip(b"\r")
            start = nl + 1
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload != b"[DONE]":
                    self._ready.append(payload)
        del self._line[:start]

    def on_message_complete(self) -> None:
        self._end("")

    # ---- state ----------------------------------------------------------------------------

    def _end(self, failure: str) -> None:
        if not self.ended:
            self.ended = True
            self.failure = failure

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def request_bytes(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The request's bytes. Header values are percent-encoded outside printable ASCII: the
    request id carries a client's session id, and a CR or LF in it must not start a header
    (or a second request) of its own on vLLM's unauthenticated port."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {quote(v, safe=HEADER_SAFE)}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def open_stream(
    host: str, port: int, request: bytes, connect_timeout_s: float
) -> tuple[asyncio.Transport, SseProtocol]:
    """Connect, send ``request`` and wait for the response's head."""
    loop = asyncio.get_running_loop()
    try:
        # not wait_for: on 3.11 a connection made as the caller is cancelled is returned,
        # the cancellation swallowed, and the request sent to vLLM anyway
        async with asyncio.timeout(connect_timeout_s):
            transport, protocol = await loop.create_connection(SseProtocol, host, port)
    except (OSError, TimeoutError) as err:
        raise Unavailable(f"vLLM server unreachable: {err!r}") from None
    try:
        transport.write(request)
        await protocol.head()  # vLLM answers once the prompt is queued: may be cancelled
    except BaseException:
        transport.close()  # vLLM aborts a request whose connection closed
        raise
    if protocol.ended and protocol.status == 0:
        transport.close()
        raise Unavailable(f"vLLM server unreachable: {protocol.failure}")
    return transport, protocol


async def payloads(protocol: SseProtocol) -> AsyncIterator[list[bytes]]:
    """The response's SSE payloads, a batch per socket read; Unavailable if it broke off."""
    while True:
        batch = await protocol.take()
        if batch:
            yield batch
        elif protocol.ended:
            if protocol.failure:
                raise Unavailable(protocol.failure)
            return


def _why(exc: Exception | None) -> str:
    return f" ({exc!r})" if exc is not None else ""
