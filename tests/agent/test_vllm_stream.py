"""The vLLM worker's streaming read of vLLM's completions (``vllm_worker.sse``), without vLLM.

A scripted HTTP server writes vLLM's wire form (chunked transfer encoding, one ``data:``
event per chunk) cut at awkward places: events split across socket writes and across
chunks, several events in one write, several tokens in one event. Whatever the cut, the
tokens must reach a gRPC client of the worker exactly as sent, in order, once; refusals and
broken streams must read as before (INVALID_ARGUMENT with vLLM's reason, UNAVAILABLE). The
vLLM tier (tests/vllm) checks the same path against real servers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import pytest

from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_agent.vllm_worker import client as client_module
from fleetshift_agent.vllm_worker import sse
from fleetshift_agent.vllm_worker.client import Chunk, Completion, VllmClient
from fleetshift_agent.vllm_worker.service import VllmIdentity, VllmWorkerServicer
from fleetshift_agent.worker.session_core import binding
from fleetshift_common.errors import InvalidArgument, Unavailable
from fleetshift_rpc.server import start_server

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def event(tokens: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": "x", "finish_reason": finish, "token_ids": tokens}
    body = {"id": "cmpl-1", "choices": [choice], "prompt_token_ids": [9, 9]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def cut(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` split into writes of these sizes (cycled)."""
    out, at, k = [], 0, 0
    while at < len(data):
        out.append(data[at : at + sizes[k % len(sizes)]])
        at += sizes[k % len(sizes)]
        k += 1
    return out


Script = Callable[[dict[str, object]], list[bytes]]


@asynccontextmanager
async def fake_vllm(script: Script) -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    """An HTTP server that answers each POST with ``script(body)``'s writes, in order."""
    bodies: list[dict[str, object]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        body = json.loads(await reader.readexactly(length))
        bodies.append(body)
        for data in script(body):
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        server.close()


def completion(max_tokens: int = 6) -> Completion:
    return Completion((1, 2, 3), max_tokens, 0.0, 1.0, 7, request_id="r-1")


async def read_all(client: VllmClient) -> list[Chunk]:
    return [c async for batch in client.stream(completion()) for c in batch]


def six_tokens() -> bytes:
    events = [event([10]), event([11, 12]), event([13]), event([14, 15], "length")]
    return HEAD + chunked(events[0], events[1] + events[2], events[3], b"data: [DONE]\n\n")


@pytest.mark.parametrize("sizes", [[1], [7, 3], [50], [4096]])
async def test_tokens_arrive_whole_and_in_order_however_the_bytes_are_cut(
    sizes: list[int],
) -> None:
    async with fake_vllm(lambda body: cut(six_tokens(), sizes)) as (url, bodies):
        client = VllmClient(url, "m")
        chunks = await read_all(client)
        await client.close()
    assert [c.tokens for c in chunks] == [(10,), (11, 12), (13,), (14, 15)]
    assert [c.finish_reason for c in chunks] == ["", "", "", "length"]
    assert bodies[0]["prompt"] == [1, 2, 3] and bodies[0]["stream"] is True


async def test_a_refusal_is_invalid_argument_with_vllms_reason() -> None:
    error = json.dumps({"error": {"message": "prompt too long", "code": 400}}).encode()
    answer = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)
    async with fake_vllm(lambda body: cut(answer, [5])) as (url, _):
        with pytest.raises(InvalidArgument, match="prompt too long"):
            await read_all(VllmClient(url, "m"))


async def test_an_error_event_or_a_cut_stream_is_unavailable() -> None:
    error = b'data: {"error": {"message": "engine dead"}}\n\n'
    async with fake_vllm(lambda body: [HEAD + chunked(event([10]), error)]) as (url, _):
        with pytest.raises(Unavailable, match="engine dead"):
            await read_all(VllmClient(url, "m"))
    broken = HEAD + b"%x\r\n%s\r\n" % (len(event([10])), event([10]))  # no final chunk
    async with fake_vllm(lambda body: [broken]) as (url, _):
        with pytest.raises(Unavailable, match="before the response ended"):
            await read_all(VllmClient(url, "m"))
    with pytest.raises(Unavailable, match="unreachable"):
        await read_all(VllmClient("http://127.0.0.1:1", "m"))


def test_the_request_is_plain_http_1_1_with_a_length() -> None:
    raw = sse.request_bytes("127.0.0.1", 8000, "/v1/completions", b"{}", {"X-Request-Id": "a"})
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Content-Length: 2" in head and b"X-Request-Id: a" in head and body == b"{}"


def session_script(body: dict[str, object]) -> list[bytes]:
    """vLLM's answer to a session of ``max_tokens``: tokens 100, 101, ... in events of one to
    three tokens, several events per write, the last event finishing by length."""
    n = int(str(body["max_tokens"]))
    events, at, size = [], 0, 1
    while at < n:
        tokens = list(range(100 + at, 100 + min(n, at + size)))
        at += len(tokens)
        events.append(event(tokens, "length" if at == n else None))
        size = size % 3 + 1
    writes = [b"".join(events[i : i + 2]) for i in range(0, len(events), 2)]
    return [HEAD, *cut(chunked(*writes, b"data: [DONE]\n\n"), [33])]


async def test_a_client_sees_exactly_vllms_tokens_once_in_order_when_events_carry_several() -> None:
    async with fake_vllm(session_script) as (url, _):
        client = VllmClient(url, "m")
        key = worker_pb2.WorkerCompatKey()
        servicer = VllmWorkerServicer(client, VllmIdentity("w", "m", key), "mixed")
        server = await start_server("127.0.0.1:0", [binding(servicer)], 4 << 20, None, ())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                request = worker_pb2.GenerateRequest(
                    prompt_tokens=[1, 2], max_new_tokens=40, session_id="s-1"
                )
                got = [m async for m in stub.Generate(request, timeout=30)]
                again = worker_pb2.GenerateRequest(resume_session_id="s-1", resume_from_token=17)
                tail = [m.token async for m in stub.Generate(again, timeout=30)]
        finally:
            await servicer.close()
            await server.server.stop(grace=None)
            await client.close()
    assert [m.token for m in got] == list(range(100, 140))
    assert [m.index for m in got] == list(range(40))
    assert [m.finished for m in got] == [False] * 39 + [True]
    assert got[-1].finish_reason == "length"
    assert tail == list(range(117, 140))


@pytest.mark.parametrize(
    "payload",
    [
        event([12]),
        event([1, 2, 3], "length"),
        event([], "stop"),
        b'data: {"choices":[{"index":0,"text":"\\"token_ids\\":[5] \\"error\\"",'
        b'"finish_reason":null,"token_ids":[7],"prompt_token_ids":[1, 2]}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n',
        b'data: {"choices":[{"index":0,"finish_reason":null,"token_ids":null}]}\n\n',
    ],
)
def test_the_quick_read_of_an_event_equals_decoding_it(payload: bytes) -> None:
    data = payload.removeprefix(b"data: ").strip()
    assert client_module._parse_event(data) == client_module._parse_json(data)


def test_a_session_id_cannot_add_a_header_or_a_request() -> None:
    raw = sse.request_bytes(
        "127.0.0.1", 8000, "/v1/completions", b"{}", {"X-Request-Id": "s\r\n\r\nPOST /pause"}
    )
    head, _, body = raw.partition(b"\r\n\r\n")
    assert body == b"{}" and head.count(b"\r\n") == 6
    assert head.endswith(b"X-Request-Id: s%0D%0A%0D%0APOST%20/pause")


async def test_a_body_that_ends_with_the_connection_is_whole() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + event([10], "length")
    async with fake_vllm(lambda body: cut(answer, [9])) as (url, _):
        chunks = await read_all(VllmClient(url, "m"))
    assert [(c.tokens, c.finish_reason) for c in chunks] == [((10,), "length")]


async def test_a_request_cancelled_before_vllm_answers_closes_its_connection() -> None:
    """vLLM aborts a request when its connection closes: a session ended (a Pause, a client
    gone) while its prompt still waits in vLLM's queue must not run on there."""
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        while await reader.read(1 << 16):  # never answers; b"" once the client closed
            pass
        closed.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    task = asyncio.create_task(read_all(VllmClient(f"http://127.0.0.1:{port}", "m")))
    await asyncio.sleep(0.2)
    task.cancel()
    await asyncio.wait_for(closed.wait(), 5)
    server.close()


async def test_an_answer_that_is_not_http_is_unavailable() -> None:
    async with fake_vllm(lambda body: [b"garbage\r\n\r\n"]) as (url, _):
        with pytest.raises(Unavailable, match=r"not HTTP/1\.1"):
            await read_all(VllmClient(url, "m"))
