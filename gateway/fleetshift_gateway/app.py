"""The OpenAI-compatible HTTP surface (Starlette): completions, chat, models, health.

It holds no state of its own beyond a gRPC channel to the daemon and the models' tokenizers,
so any number of gateways can run side by side. A request is checked in full before Route is
called; the first token is awaited before the response starts, so a refusal up to then gets
its own HTTP status, and a failure after it ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fleetshift.v1 import worker_pb2
from fleetshift_gateway import requests as parse
from fleetshift_gateway.errors import ApiError, bad_request, from_rpc
from fleetshift_gateway.metrics import GatewayMetrics
from fleetshift_gateway.routes import DEFAULT_ROUTE_CACHE_S, Router
from fleetshift_gateway.tokenizer import ModelTokenizer
from fleetshift_gateway.upstream import WorkerChannels, serve
from fleetshift_rpc.sessions import SessionLost

log = logging.getLogger("fleetshift.gateway")
DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass
class Gateway:
    daemon: grpc.aio.Channel
    models: dict[str, ModelTokenizer]
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    channels: WorkerChannels = field(default_factory=WorkerChannels)
    token: str = ""  # non-empty: every /v1 request must carry "Authorization: Bearer <token>"
    route_cache_s: float = DEFAULT_ROUTE_CACHE_S  # 0: every request waits for its own Route
    router: Router = field(init=False)

    def __post_init__(self) -> None:
        self.router = Router(self.daemon, self.route_cache_s, on_answer=self.metrics.route_answer)


@dataclass
class _Call:
    """One request's identity and clock, for its response, its logs and its metrics."""

    kind: str  # "completion" or "chat"
    request_id: str
    started: float
    created: int
    checked: float = 0.0  # time.monotonic() once its body was read and checked
    routed: float = 0.0  # and once its route was known

    def route_known(self) -> None:
        self.routed = time.monotonic()

    def server_timing(self, first: float) -> str:
        """Where the time to the first token went, in ms (the Server-Timing header, W3C):
        reading and checking the request (``read``), its route (a Route call, or a kept
        answer), the worker (the gRPC call, prefill, the first token back) and the whole."""
        checked = self.checked or self.started
        routed = self.routed or checked
        return (
            f"read;dur={(checked - self.started) * 1e3:.3f}, "
            f"route;dur={(routed - checked) * 1e3:.3f}, "
            f"upstream;dur={(first - routed) * 1e3:.3f}, "
            f"total;dur={(first - self.started) * 1e3:.3f}"
        )

    @classmethod
    def new(cls, kind: str) -> _Call:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, f"{prefix}-{uuid.uuid4().hex}", time.monotonic(), int(time.time()))

    @property
    def session_id(self) -> str:
        return f"gw-{self.request_id}"


def build_app(gw: Gateway) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _generate(gw, request, _Call.new("completion"), parse.completion)

    async def chat(request: Request) -> Response:
        return await _generate(gw, request, _Call.new("chat"), parse.chat)

    async def models(request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "fleetshift"}
            for name in sorted(gw.models)
        ]
        gw.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": sorted(gw.models)})

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
    if gw.token:
        app.add_middleware(_Bearer, gw=gw)
    return app


class _Bearer:
    """Like the daemon's operator port: a bearer token, compared in constant time. /health
    stays open for load balancers.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` passes every streamed event
    through a memory stream and a second task, ~24 us of CPU per event and +0.5 ms to the
    first one (``bench/gateway_stream_probe.py``, docs/benchmarks.md round 5)."""

    def __init__(self, app: ASGIApp, gw: Gateway) -> None:
        self.app, self.gw = app, gw
        self.expected = f"Bearer {gw.token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "a valid bearer token is required", code="invalid_api_key")
        await _refuse(self.gw, scope["path"], _Call.new("auth"), err)(scope, receive, send)


Parser = Callable[[dict[str, Any], dict[str, ModelTokenizer]], parse.Generation]


async def _generate(gw: Gateway, request: Request, call: _Call, parser: Parser) -> Response:
    endpoint = request.url.path
    try:
        raw = await _read_body(request, gw.max_body_bytes)
        gen = parser(parse.parse_body(raw, request.headers.get("content-type", "")), gw.models)
        call.checked = time.monotonic()
        stream = _tokens(gw, gen, call)
        first = await anext(stream)  # a refusal before the first token keeps its own status
    except ApiError as err:
        return _refuse(gw, endpoint, call, err)
    now = time.monotonic()
    gw.metrics.of_model(gen.model.name).ttft.observe(now - call.started)
    headers = {"x-request-id": call.request_id, "server-timing": call.server_timing(now)}
    gw.metrics.requests.labels(endpoint, "200").inc()
    if gen.stream:
        body = _sse(gw, gen, call, first, stream)
        return _EventStream(body, headers)
    try:
        return JSONResponse(await _whole(gw, gen, call, first, stream), headers=headers)
    except ApiError as err:  # nothing sent yet: the failure keeps its own status
        return _refuse(gw, endpoint, call, err)


def _refuse(gw: Gateway, endpoint: str, call: _Call, err: ApiError) -> Response:
    gw.metrics.requests.labels(endpoint, str(err.status)).inc()
    gw.metrics.errors.labels(err.cause).inc()
    log.info(
        "%s %s refused %d %s: %s", call.request_id, endpoint, err.status, err.param, err.message
    )
    headers = {"x-request-id": call.request_id, **err.headers}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return bad_request("body", f"the body is {size} bytes, over the limit of {limit}", "too_large")


async def _tokens(
    gw: Gateway, gen: parse.Generation, call: _Call
) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """The session's tokens; every upstream failure becomes an ApiError."""

    def refused(endpoint: str, err: grpc.aio.AioRpcError) -> None:
        gw.metrics.split_fallbacks.labels(err.code().name).inc()
        log.info(
            "%s hand-over to %s refused (%s: %s): served elsewhere",
            call.request_id,
            endpoint,
            err.code().name,
            err.details(),
        )

    try:
        async for msg in serve(
            gw.router, gw.channels, gen, call.session_id, refused, call.route_known
        ):
            yield msg
    except grpc.aio.AioRpcError as err:
        raise from_rpc(err, gen.model.name, routed=bool(call.routed)) from err
    except SessionLost as err:
        raise ApiError(503, f"the session was lost: {err}", code="session_lost") from err


class _EventStream(Response):
    """A server-sent event stream, written from the request's own task.

    Starlette's ``StreamingResponse`` (under an ASGI 2.3 server such as uvicorn) writes from a
    second task in an anyio task group, one per stream, while the first waits for the client
    to go: +0.16 ms to the first event and +0.17 ms of CPU per 64-event stream
    (``bench/gateway_stream_probe.py``, docs/benchmarks.md round 5). Here a plain asyncio
    task waits for the disconnect and cancels the request's task, which ends the worker call
    as before ("client gone")."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"ended": False, "gone": False}

        def client_gone(watcher: asyncio.Future[None]) -> None:
            if not (state["ended"] or watcher.cancelled()):
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(client_gone)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            state["ended"] = True  # the last write completes the response, which ends receive()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()  # the client went away: nothing is left to answer
        finally:
            state["ended"] = True
            watcher.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Piece:
    text: str
    finish_reason: str | None


async def _pieces(
    gw: Gateway,
    gen: parse.Generation,
    first: worker_pb2.GenerateResponse,
    rest: AsyncIterator[worker_pb2.GenerateResponse],
) -> AsyncIterator[_Piece]:
    """One text delta per generated token (empty while a UTF-8 character is incomplete).

    The token counter and the TBT histogram are fed once the stream ends (or breaks): an
    ``observe`` per token cost ~25 us between two tokens, a tenth of the gateway's own
    per-token work, so the series trail a running stream rather than slow it."""
    decoder, series = gen.model.stream_decoder(), gw.metrics.of_model(gen.model.name)
    msg, stamps = first, [time.monotonic()]
    try:
        while True:
            text = decoder.push(msg.token)
            if msg.finished:
                yield _Piece(text + decoder.flush(), msg.finish_reason or "length")
                return
            yield _Piece(text, None)
            msg = await anext(rest)
            stamps.append(time.monotonic())
    finally:
        series.tokens.inc(len(stamps))
        for before, after in itertools.pairwise(stamps):
            series.tbt.observe(after - before)


async def _whole(
    gw: Gateway,
    gen: parse.Generation,
    call: _Call,
    first: worker_pb2.GenerateResponse,
    rest: AsyncIterator[worker_pb2.GenerateResponse],
) -> dict[str, Any]:
    texts, finish, count = [], "length", 0
    async for piece in _pieces(gw, gen, first, rest):
        texts.append(piece.text)
        count += 1
        finish = piece.finish_reason or finish
    _log_served(call, gen, count, finish)
    text = "".join(texts)
    if call.kind == "chat":
        choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice, obj = {"text": text, "logprobs": None}, "text_completion"
    return {
        **_head(gen, call, obj),
        "choices": [{"index": 0, **choice, "finish_reason": finish}],
        "usage": _usage(gen, count),
    }


async def _sse(
    gw: Gateway, gen: parse.Generation, call: _Call, first: worker_pb2.GenerateResponse, rest: Any
) -> AsyncIterator[bytes]:
    chat = call.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    head, count = _head(gen, call, obj), 0
    frame = _Framer(head, chat)
    outcome = "client gone"  # the stream closed by the server when the client disconnects
    try:
        if chat:
            yield _event({**head, "choices": [_delta(chat, {"role": "assistant", "content": ""})]})
        async for piece in _pieces(gw, gen, first, rest):
            count += 1
            if piece.finish_reason is None:
                yield frame.text(piece.text)
                continue
            outcome = piece.finish_reason
            choice = _delta(chat, {"content": piece.text} if chat else piece.text)
            choice["finish_reason"] = piece.finish_reason
            yield _event({**head, "choices": [choice]})
    except ApiError as err:  # after the first token the status is sent: say it in the stream
        gw.metrics.errors.labels(err.cause).inc()
        log.warning("%s stream failed after %d tokens: %s", call.request_id, count, err.message)
        outcome = "failed"
        yield _event(err.body())
        return
    finally:
        _log_served(call, gen, count, outcome)
    if gen.include_usage:
        yield _event({**head, "choices": [], "usage": _usage(gen, count)})
    yield b"data: [DONE]\n\n"


def _log_served(call: _Call, gen: parse.Generation, tokens: int, outcome: str) -> None:
    """One line per answered request, written once its tokens are out: a formatted log write
    on the way to the first token cost it ~0.5 ms in the gateway's profile."""
    log.info(
        "%s %s model=%s prompt=%d tokens=%d %s in %.0f ms",
        call.request_id,
        call.kind,
        gen.model.name,
        len(gen.prompt),
        tokens,
        outcome,
        (time.monotonic() - call.started) * 1e3,
    )


class _Framer:
    """A stream's token events, framed once: every event but the last differs only in its
    text, so the JSON around it is rendered at the start and each token encodes just its
    string (what ``_event`` would produce for the same chunk, byte for byte)."""

    _MARK = "\x00text\x00"

    def __init__(self, head: dict[str, Any], chat: bool) -> None:
        choice = _delta(chat, {"content": self._MARK} if chat else self._MARK)
        before, after = _event({**head, "choices": [choice]}).split(json.dumps(self._MARK).encode())
        self._before, self._after = before, after

    def text(self, text: str) -> bytes:
        return self._before + json.dumps(text).encode() + self._after


def _delta(chat: bool, delta: Any) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
    return {"index": 0, "text": delta, "finish_reason": None, "logprobs": None}


def _head(gen: parse.Generation, call: _Call, obj: str) -> dict[str, Any]:
    return {"id": call.request_id, "object": obj, "created": call.created, "model": gen.model.name}


def _usage(gen: parse.Generation, completion_tokens: int) -> dict[str, int]:
    prompt = len(gen.prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
