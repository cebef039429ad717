"""One streaming HTTP/1.1 request to the local vLLM server, read as server-sent events.

Why not httpx here: every token of every session crosses this path, and httpx (through
httpcore, h11 and anyio) runs several layers of async generators, a cancel scope and a
decoder per chunk read: measured, that was about a third of the vLLM worker's CPU per token
(docs/vllm.md, Benchmarks). vLLM's server is on 127.0.0.1, speaks plain HTTP/1.1 and frames a
streaming answer with chunked transfer encoding, one ``data: {json}`` event per chunk, so a
protocol object that splits the bytes as they arrive is enough: one wake-up of the reading
task per socket read (however many events it carries), no per-chunk objects but the
payloads. The rest of the shim's HTTP (health, metrics, pause) stays on httpx: it is rare.

Each request has its own connection: a session's request lasts for its whole output, and
closing the connection is how vLLM learns a request was abandoned (it aborts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import quote

from fleetshift_common.errors import Unavailable

MAX_HEAD_BYTES = 64 << 10  # a response head larger than this is not vLLM's
HEADER_SAFE = "!#$&'()*+,/:;=?@[]^_`{|}~-."  # printable ASCII kept as is (and letters, digits)


class SseProtocol(asyncio.Protocol):
    """Parses one HTTP/1.1 response (head, then a chunked or length-framed body) into SSE
    payloads. Runs inside the event loop's reads: it only splits bytes and wakes the reader;
    parsing the JSON is the reader's (an error there belongs to the session, not the loop)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.error_body = bytearray()
        self.ended = False
        self.failure = ""
        self._ready: list[bytes] = []  # payloads not yet taken
        self._buf = bytearray()  # unparsed bytes of the head or of the chunk framing
        self._line = bytearray()  # the SSE line being assembled from body bytes
        self._head = True
        self._chunked = False
        self._left = -1  # bytes left of the current chunk (chunked) or of the body (length)
        self._waiter: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's does not subclass asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            if self._head and not self._parse_head():
                return
            self._parse_body()
        except (ValueError, IndexError) as err:
            self._end(f"vLLM's response is not HTTP/1.1 as expected: {err!r}")
            if self.transport is not None:
                self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            # A body with neither a length nor chunks ends with the connection (HTTP/1.1).
            by_close = not self._head and not self._chunked and self._left < 0 and exc is None
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

    # ---- parsing --------------------------------------------------------------------------

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                raise ValueError("response head too large")
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        self.status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self._chunked = "chunked" in headers.get("transfer-encoding", "")
        if not self._chunked:
            self._left = int(headers.get("content-length", "-1"))
        self._head = False
        return True

    def _parse_body(self) -> None:
        if not self._chunked:
            self._body(bytes(self._buf) if self._left < 0 else bytes(self._buf[: self._left]))
            if self._left >= 0:
                self._left -= min(self._left, len(self._buf))
                if self._left == 0:
                    self._end("")
            self._buf.clear()
            return
        while not self.ended:
            if self._left > 0:  # inside a chunk's data
                take = bytes(self._buf[: self._left])
                del self._buf[: len(take)]
                self._left -= len(take)
                self._body(take)
                if self._left > 0:
                    return
            end = self._buf.find(b"\r\n")
            if end < 0:
                return
            size_line = bytes(self._buf[:end])
            del self._buf[: end + 2]
            if self._left == 0:  # the CRLF after a chunk's data
                if size_line:
                    raise ValueError("chunk data longer than its size")
                self._left = -1
                continue
            self._left = int(size_line.split(b";", 1)[0], 16)
            if self._left == 0:
                self._end("")

    def _body(self, data: bytes) -> None:
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

    def _end(self, failure: str) -> None:
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
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(SseProtocol, host, port), connect_timeout_s
        )
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
