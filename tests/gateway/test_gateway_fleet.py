"""The gateway in front of a real fleet (daemon, agents, reference-engine workers), driven by
the official ``openai`` client over real HTTP: completions and chat, streamed and not; four
streams that cross a warm move and still see exactly an unmoved run's tokens; refusals that
leave the traffic mix unchanged; a daemon that goes down and comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from fleetshift_gateway.tokenizer import ModelTokenizer

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift.v1 import worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet
from tests.e2e.conftest import MODEL, SESSIONS, make_fleet, request
from tests.e2e.conftest import model_dir as model_dir  # the session fixture

from .procs import gateway

pytestmark = pytest.mark.slow
TOKENS = 400


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[tuple[LocalFleet, str, str]]:
    """A fleet with one mixed worker on h100-a, and a gateway: (fleet, base URL, endpoint)."""
    root = tmp_path_factory.mktemp("gw-fleet")
    fleet = make_fleet(root / "fleet", model_dir)
    try:
        fleet.start(timeout_s=120)
        worker = asyncio.run(_start_worker(fleet))
        with gateway(root, fleet.daemon_address, MODEL, model_dir) as url:
            yield fleet, url, worker.endpoint
    finally:
        fleet.stop()


async def _start_worker(fleet: LocalFleet) -> fpb.WorkerStatus:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        return await pb_grpc.OperationsStub(ch).StartWorker(
            pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name="h100-a"),
            timeout=180,
        )


async def direct(endpoint: str, tokens: int) -> dict[str, list[int]]:
    """What each session produces on the worker called directly, nothing moving it."""
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        async def one(s: tuple[str, list[int], float, int | None]) -> list[int]:
            return [m.token async for m in stub.Generate(request(s, tokens, f"-ref{time.time()}"))]

        results = await asyncio.gather(*(one(s) for s in SESSIONS))
    return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}


def deltas(tok: ModelTokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    out = [decoder.push(t) for t in ids]
    out[-1] += decoder.flush()
    return out


def sampling(session: tuple[str, list[int], float, int | None]) -> dict[str, object]:
    _, _, temperature, seed = session
    if seed is None:
        return {"temperature": temperature}
    return {"temperature": temperature, "top_p": 0.9, "seed": seed}


def traffic_requests(fleet: LocalFleet) -> int:
    with grpc.insecure_channel(fleet.daemon_address) as ch:
        mix = ppb_grpc.PlanningStub(ch).GetTrafficMix(ppb.GetTrafficMixRequest(model=MODEL))
    return sum(m.requests_in_window for m in mix.models)


def test_completions_and_chat_streamed_and_whole(
    served: tuple[LocalFleet, str, str], model_dir: Path
) -> None:
    _, url, endpoint = served
    tok = ModelTokenizer.load(MODEL, model_dir)
    expected = asyncio.run(direct(endpoint, 12))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    greedy = SESSIONS[0]
    whole = client.completions.create(model=MODEL, prompt=greedy[1], max_tokens=12, temperature=0)
    assert whole.choices[0].text == "".join(deltas(tok, expected[greedy[0]]))
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(greedy[1]), 12)
    assert whole.id.startswith("cmpl-")
    streamed = client.completions.create(
        model=MODEL, prompt=greedy[1], max_tokens=12, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in streamed]
    assert pieces == deltas(tok, expected[greedy[0]])

    messages = [{"role": "user", "content": "Where does my session live?"}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type]
    )
    content = chat.choices[0].message.content
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert len(text) == 10 and "".join(t or "" for t in text) == content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    reply = httpx.post(
        url + "/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert reply.headers["x-request-id"] == reply.json()["id"]


def test_four_streams_cross_a_warm_move_with_no_gap_or_repeat(
    served: tuple[LocalFleet, str, str], model_dir: Path
) -> None:
    fleet, url, endpoint = served
    tok = ModelTokenizer.load(MODEL, model_dir)
    expected = asyncio.run(direct(endpoint, TOKENS))
    got, op = asyncio.run(_stream_across_move(fleet, url, endpoint))
    assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
    step = op.steps[0]
    assert step.kind == pb.STEP_KIND_MIGRATE and step.phase == "done"
    assert step.sessions_carried == len(SESSIONS), "the move should catch every stream mid-way"
    for sid, ids in expected.items():
        assert got[sid] == deltas(tok, ids), sid  # one delta per token, in order, once


async def _stream_across_move(
    fleet: LocalFleet, url: str, endpoint: str
) -> tuple[dict[str, list[str]], pb.Operation]:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    seen: dict[str, int] = {}
    started = asyncio.Event()

    async def one(session: tuple[str, list[int], float, int | None]) -> list[str]:
        pieces: list[str] = []
        stream = await client.completions.create(
            model=MODEL, prompt=session[1], max_tokens=TOKENS, stream=True, **sampling(session)
        )
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            seen[session[0]] = len(pieces)
            if len(seen) == len(SESSIONS) and min(seen.values()) >= 20:
                started.set()
        return pieces

    streams = asyncio.gather(*(one(s) for s in SESSIONS))
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        listed = await ppb_grpc.PlanningStub(daemon).ListWorkers(ppb.ListWorkersRequest())
        worker_id = next(w.worker_id for w in listed.workers if w.endpoint == endpoint)
        await asyncio.wait_for(started.wait(), 120)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker_id, target_node="h100-b", reason="gw test"),
            timeout=30,
        )
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
    results = await asyncio.wait_for(streams, 300)
    return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}, op


def test_refused_requests_are_not_routed_or_counted(served: tuple[LocalFleet, str, str]) -> None:
    fleet, url, _ = served
    before = traffic_requests(fleet)
    bad = [
        {"model": MODEL, "prompt": "hi", "max_tokens": -3},
        {"model": MODEL, "prompt": "hi", "max_tokens": 10**7},
        {"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1},
        {"model": "unknown", "prompt": "hi", "max_tokens": 1},
    ]
    statuses = [httpx.post(url + "/completions", json=b, timeout=30).status_code for b in bad]
    assert statuses == [400, 400, 400, 404]
    bad_json = httpx.post(
        url + "/chat/completions",
        content=b"{",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad_json.status_code == 400
    assert traffic_requests(fleet) == before
    ok = httpx.post(
        url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200, ok.text
    assert traffic_requests(fleet) == before + 1  # the mix does count a served request


def test_daemon_down_is_503_then_the_gateway_recovers(served: tuple[LocalFleet, str, str]) -> None:
    fleet, url, _ = served
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
    fleet.kill_daemon()
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert caught.value.status_code == 503 and "daemon is unavailable" in str(caught.value)
    fleet.start_daemon(timeout_s=120)
    deadline = time.monotonic() + 90
    while True:
        try:
            reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            break
        except openai.InternalServerError:  # 503 until the daemon knows its workers again
            assert time.monotonic() < deadline, "the gateway did not recover"
            time.sleep(0.5)
    assert reply.usage is not None and reply.usage.completion_tokens == 2
