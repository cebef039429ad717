"""The gateway in front of a real fleet (daemon, agents, reference-engine workers), driven by
the official ``openai`` client over real HTTP: completions and chat, streamed and not; four
streams that cross a warm and then a cold move and still see exactly an unmoved run's tokens;
refusals that leave the traffic mix unchanged; requests started on a kept Route answer,
each still counted once; HTTPS with the fleet CA and a bearer token; a
SIGKILLed gateway that loses only its own connection; a split (prefill worker, then decode
worker) answer served as one stream, and its fallbacks when the decode worker lacks KV (the
prefill worker decodes it; or, that one gone too, a worker a fresh Route names); a daemon that
goes down and comes back.

One fleet serves the whole module (starting one costs tens of seconds on a loaded 2-core
machine), so the tests run in file order and each looks up where the worker is now."""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import httpx2
import openai
import pytest
from fleetshift_gateway.requests import Generation
from fleetshift_gateway.routes import Router
from fleetshift_gateway.tokenizer import ModelTokenizer
from fleetshift_gateway.upstream import WorkerChannels, serve

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift.v1 import worker_pb2 as wpb
from fleetshift.v1 import worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet
from tests.e2e.conftest import MODEL, SESSIONS, make_fleet, request
from tests.e2e.conftest import model_dir as model_dir  # the session fixture

from .procs import GatewayProcess, gateway, start_gateway, stop

pytestmark = pytest.mark.slow
TOKENS = 400  # long enough for four streams to be mid-way when a move runs
SHORT = 120  # where nothing has to be caught mid-way: a prefix of the TOKENS-long reference
STEPS = 40  # engine steps the SIGKILL test lets both sessions take before the kill


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


@pytest.fixture(scope="module")
def expected(served: tuple[LocalFleet, str, str]) -> dict[str, list[int]]:
    """What each session produces on the mixed worker called directly, nothing moving it
    (the reference engine is deterministic across workers: moved sessions are compared to it)."""
    (worker,) = asyncio.run(_serving(served[0]))
    return asyncio.run(direct(worker.endpoint, TOKENS))


async def _serving(fleet: LocalFleet) -> list[fpb.WorkerStatus]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        listed = await ppb_grpc.PlanningStub(ch).ListWorkers(ppb.ListWorkersRequest())
    return [w for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING]


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


@pytest.mark.parametrize(
    ("target", "kind"),
    [("h100-b", pb.STEP_KIND_MIGRATE), ("h200-a", pb.STEP_KIND_COLD_START)],
    ids=["warm-h100-to-h100", "cold-h100-to-h200"],
)
def test_four_streams_cross_a_move_with_no_gap_or_repeat(
    served: tuple[LocalFleet, str, str],
    model_dir: Path,
    expected: dict[str, list[int]],
    target: str,
    kind: pb.StepKind,
) -> None:
    fleet, url, _ = served
    tok = ModelTokenizer.load(MODEL, model_dir)
    got, op = asyncio.run(_stream_across_move(fleet, url, target))
    assert op.state == pb.OPERATION_STATE_SUCCEEDED, op
    step = op.steps[0]
    assert step.kind == kind and step.phase == "done"
    assert step.sessions_carried == len(SESSIONS), "the move should catch every stream mid-way"
    for sid, ids in expected.items():
        assert got[sid] == deltas(tok, ids), sid  # one delta per token, in order, once
    assert [w.node_name for w in asyncio.run(_serving(fleet))] == [target]


async def _stream_across_move(
    fleet: LocalFleet, url: str, target: str
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

    (worker,) = await _serving(fleet)
    streams = asyncio.gather(*(one(s) for s in SESSIONS))
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        await asyncio.wait_for(started.wait(), 120)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target, reason="gw test"),
            timeout=30,
        )
        async for update in ops.WatchOperation(pb.WatchOperationRequest(operation_id=op.id)):
            op = update
    results = await asyncio.wait_for(streams, 300)
    return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}, op


# Every bad request of issue 15's list: (what is sent, status, the field its error names).
JSON = {"content-type": "application/json"}
BAD_REQUESTS = [
    ({"json": {"model": "unknown", "prompt": "hi", "max_tokens": 1}}, 404, "model"),
    ({"json": {"model": MODEL, "prompt": "hi", "max_tokens": -3}}, 400, "max_tokens"),
    ({"json": {"model": MODEL, "prompt": "hi", "max_tokens": 10**7}}, 400, "max_tokens"),
    ({"json": {"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1}}, 400, "prompt"),
    ({"content": b'{"model": "small", "prompt": ', "headers": JSON}, 400, "body"),
    ({"json": {"model": MODEL, "prompt": "x" * (2 << 20), "max_tokens": 1}}, 400, "body"),
    ({"content": b"model=small&prompt=hi", "headers": {"content-type": "text/plain"}}, 400,
     "content-type"),
]  # fmt: skip


def as_chat(sent: dict[str, object]) -> dict[str, object]:
    """The same refusal case for /v1/chat/completions: the prompt becomes one user message."""
    body = sent.get("json")
    if not isinstance(body, dict) or "prompt" not in body:
        return sent
    prompt = body["prompt"]
    content = prompt if isinstance(prompt, str) else "hi " * len(prompt)  # [1] * 5000: too long
    rest = {k: v for k, v in body.items() if k != "prompt"}
    return {"json": {**rest, "messages": [{"role": "user", "content": content}]}}


def test_refused_requests_are_not_routed_or_counted(served: tuple[LocalFleet, str, str]) -> None:
    fleet, url, _ = served
    before = traffic_requests(fleet)
    for sent, status, param in BAD_REQUESTS:
        assert isinstance(sent, dict)
        for path, body, named in (
            ("/completions", sent, param),
            ("/chat/completions", as_chat(sent), "messages" if param == "prompt" else param),
        ):
            reply = httpx.post(url + path, timeout=30, **body)  # type: ignore[arg-type]
            assert reply.status_code == status, (path, param, reply.text)
            error = reply.json()["error"]
            assert error["param"] == named, (path, error)
            assert named.lower() in error["message"].lower() or status == 404, error
            assert reply.headers["x-request-id"] and "Traceback" not in reply.text
    assert traffic_requests(fleet) == before
    ok = httpx.post(
        url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200, ok.text
    assert traffic_requests(fleet) == before + 1  # the mix does count a served request


def test_requests_started_on_a_kept_route_are_each_counted_once(
    served: tuple[LocalFleet, str, str], model_dir: Path, tmp_path: Path
) -> None:
    """Requests of one shape back to back through a gateway that keeps Route answers (30 s
    here, so every request after the first starts on the kept one): the first waits for its
    Route, the others do not, and the traffic mix still counts each exactly once by the time
    its client has the whole answer."""
    fleet, _, _ = served
    metrics = free_port()
    extra = ("--route-cache-s", "30", "--metrics-port", str(metrics))
    with gateway(tmp_path, fleet.daemon_address, MODEL, model_dir, *extra) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        before = traffic_requests(fleet)
        for i in range(6):
            if i % 2:
                whole = client.completions.create(
                    model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0
                )
                assert whole.usage is not None and whole.usage.completion_tokens == 3
            else:
                chunks = client.completions.create(
                    model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0, stream=True
                )
                assert len([c for c in chunks if c.choices]) == 3
            assert traffic_requests(fleet) == before + i + 1  # counted once the answer is out
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        timed = httpx.post(url + "/completions", json=body, timeout=60)
        spent = dict(p.strip().split(";dur=") for p in timed.headers["server-timing"].split(","))
        assert set(spent) == {"read", "route", "upstream", "total"}, spent
        parts = float(spent["read"]) + float(spent["route"]) + float(spent["upstream"])
        assert abs(parts - float(spent["total"])) < 0.01, spent  # the whole, in its parts
        scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
    assert 'fleetshift_gateway_route_answers_total{source="daemon"} 1.0' in scraped, scraped
    assert 'fleetshift_gateway_route_answers_total{source="kept"} 6.0' in scraped, scraped


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def certs(*args: str) -> None:
    cmd = [sys.executable, "-m", "fleetshift_daemon.cli.main", "certs", *args]
    subprocess.run(cmd, check=True, capture_output=True)


def test_https_with_the_fleet_ca_and_a_bearer_token(
    served: tuple[LocalFleet, str, str],
    model_dir: Path,
    expected: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    fleet = served[0]
    pki = tmp_path / "pki"
    certs("init-ca", str(pki))
    certs("issue-server", str(pki), "gateway", "--san-ip", "127.0.0.1")
    (tmp_path / "token").write_text("s3cret-gw-token\n")
    cert, key = pki / "daemon-gateway.crt", pki / "daemon-gateway.key"
    tls = ("--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(tmp_path / "token"))
    with gateway(tmp_path, fleet.daemon_address, MODEL, model_dir, *tls, scheme="https") as url:
        assert url.startswith("https://")
        # the openai client's own HTTP stack (httpx2), trusting the CA that signed the gateway
        trusted = httpx2.Client(verify=ssl.create_default_context(cafile=str(pki / "ca.crt")))
        client = openai.OpenAI(
            base_url=url, api_key="s3cret-gw-token", max_retries=0, http_client=trusted
        )
        greedy = SESSIONS[0]
        reply = client.completions.create(
            model=MODEL, prompt=greedy[1], max_tokens=8, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        tok = ModelTokenizer.load(MODEL, model_dir)
        assert reply.choices[0].text == tok.decode(expected[greedy[0]][:8])
        wrong = openai.OpenAI(base_url=url, api_key="guess", max_retries=0, http_client=trusted)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        untrusted = openai.OpenAI(base_url=url, api_key="s3cret-gw-token", max_retries=0)
        with pytest.raises(openai.APIConnectionError):  # the system CAs do not know the fleet's
            untrusted.models.list()
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            httpx.get(plain + "/models", timeout=10)
        trusted.close()


def test_sigkilled_gateway_loses_only_its_own_connection(
    served: tuple[LocalFleet, str, str],
    model_dir: Path,
    expected: dict[str, list[int]],
    tmp_path: Path,
) -> None:
    fleet, url, _ = served
    doomed = start_gateway(tmp_path / "doomed", fleet.daemon_address, MODEL, model_dir)
    try:
        outcome = asyncio.run(_kill_one_gateway_mid_stream(fleet, url, doomed))
    finally:
        stop(doomed)
    tok = ModelTokenizer.load(MODEL, model_dir)
    kept, killed = SESSIONS[1], SESSIONS[0]
    assert outcome["kept"] == deltas(tok, expected[kept[0]][:SHORT])
    assert isinstance(outcome["error"], openai.APIConnectionError | httpx2.TransportError), outcome
    # The worker cancelled the orphaned session instead of generating it to its end.
    assert isinstance(outcome["decoded"], int) and outcome["decoded"] < SHORT + TOKENS
    again = start_gateway(tmp_path / "again", fleet.daemon_address, MODEL, model_dir)
    try:
        client = openai.OpenAI(base_url=again.url, api_key="unused", max_retries=0, timeout=300)
        retry = client.completions.create(
            model=MODEL, prompt=killed[1], max_tokens=SHORT, temperature=0, stream=True
        )
        assert [c.choices[0].text for c in retry] == deltas(tok, expected[killed[0]][:SHORT])
    finally:
        stop(again)


async def _kill_one_gateway_mid_stream(
    fleet: LocalFleet, url: str, doomed: GatewayProcess
) -> dict[str, object]:
    """One stream through the doomed gateway (long: 5 x TOKENS), one through the module's;
    the doomed one is SIGKILLed once both are mid-stream.

    The worker is paused while both sessions start and then single-stepped (STEPS steps,
    after which it pauses again), so at the kill the doomed session is mid-way whatever the
    machine's load: a starved gateway must not let the worker finish the session before the
    kill, which would leave the test nothing to check (a CI run at load 21 did exactly that)."""
    both = asyncio.Event()
    counts = {"kept": 0, "killed": 0}
    (worker,) = await _serving(fleet)
    before = await _counters(worker.endpoint)

    async def run(base: str, session: tuple[str, list[int], float, int | None], name: str,
                  tokens: int) -> list[str]:  # fmt: skip
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
        pieces: list[str] = []
        stream = await client.completions.create(
            model=MODEL, prompt=session[1], max_tokens=tokens, stream=True, temperature=0
        )
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            counts[name] = len(pieces)
            if min(counts.values()) >= 10:
                both.set()
        return pieces

    async with grpc.aio.insecure_channel(worker.endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        await stub.Pause(wpb.WorkerPauseRequest(), timeout=30)
        try:
            kept = asyncio.create_task(run(url, SESSIONS[1], "kept", SHORT))
            killed = asyncio.create_task(run(doomed.url, SESSIONS[0], "killed", 5 * TOKENS))
            await _wait_live(worker.endpoint, 2)
            await stub.Resume(wpb.WorkerResumeRequest(steps=STEPS), timeout=30)
            await asyncio.wait_for(both.wait(), 120)
            doomed.proc.send_signal(signal.SIGKILL)
            error: BaseException | None = None
            try:
                await asyncio.wait_for(killed, 60)
            except (openai.APIError, httpx2.HTTPError) as err:
                error = err
            await _wait_live(worker.endpoint, 1)  # the orphan is cancelled, paused or not
        finally:
            await stub.Resume(wpb.WorkerResumeRequest(), timeout=30)
    result = await asyncio.wait_for(kept, 300)
    after = await _wait_idle(worker.endpoint)
    return {"kept": result, "error": error, "decoded": after.decode_tokens - before.decode_tokens}


async def _wait_live(endpoint: str, sessions: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while (counters := await _counters(endpoint)).live_sessions != sessions:
        assert time.monotonic() < deadline, f"not {sessions} live sessions: {counters}"
        await asyncio.sleep(0.1)


def test_a_client_closing_its_stream_ends_the_worker_session(
    served: tuple[LocalFleet, str, str], model_dir: Path, expected: dict[str, list[int]]
) -> None:
    """The gateway notices a client that goes away mid-stream (its connection closed, the
    gateway still up) and cancels the worker's session instead of decoding it to its end."""
    fleet, url, _ = served
    decoded = asyncio.run(_close_mid_stream(fleet, url))
    assert 10 <= decoded < TOKENS  # of the 5 x TOKENS asked for, as in the SIGKILL test
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    session = SESSIONS[1]
    again = client.completions.create(
        model=MODEL, prompt=session[1], max_tokens=SHORT, temperature=0, stream=True
    )
    tok = ModelTokenizer.load(MODEL, model_dir)
    assert [c.choices[0].text for c in again] == deltas(tok, expected[session[0]][:SHORT])


async def _close_mid_stream(fleet: LocalFleet, url: str) -> int:
    (worker,) = await _serving(fleet)
    before = await _counters(worker.endpoint)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    stream = await client.completions.create(
        model=MODEL, prompt=SESSIONS[0][1], max_tokens=5 * TOKENS, stream=True, temperature=0
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 10:
            break
    await stream.close()
    after = await _wait_idle(worker.endpoint)
    await client.close()
    return after.decode_tokens - before.decode_tokens


async def _counters(endpoint: str) -> fpb.WorkerCounters:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        counters: fpb.WorkerCounters = await stub.GetCounters(
            wpb.GetWorkerCountersRequest(), timeout=10
        )
    return counters


async def _wait_idle(endpoint: str, timeout_s: float = 120) -> fpb.WorkerCounters:
    deadline = time.monotonic() + timeout_s
    while (counters := await _counters(endpoint)).live_sessions:
        assert time.monotonic() < deadline, f"sessions still live: {counters}"
        await asyncio.sleep(0.2)
    return counters


def test_split_answer_is_served_end_to_end(
    served: tuple[LocalFleet, str, str], model_dir: Path, expected: dict[str, list[int]]
) -> None:
    """With only a prefill and a decode worker, Route answers a pair; the gateway runs the
    prompt on the first, hands the session to the second and serves one stream whose tokens
    are a mixed worker's."""
    fleet, url, _ = served
    prefill, decode = asyncio.run(_split_pool(fleet))
    routed = _route(fleet)
    assert (routed.endpoint, routed.decode_endpoint) == (prefill.endpoint, decode.endpoint)
    before = {w.endpoint: asyncio.run(_counters(w.endpoint)) for w in (prefill, decode)}
    tok = ModelTokenizer.load(MODEL, model_dir)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    greedy, seeded = SESSIONS[0], SESSIONS[2]
    streamed = client.completions.create(
        model=MODEL, prompt=greedy[1], max_tokens=SHORT, stream=True, temperature=0
    )
    assert [c.choices[0].text for c in streamed] == deltas(tok, expected[greedy[0]][:SHORT])
    whole = client.completions.create(
        model=MODEL,
        prompt=seeded[1],
        max_tokens=SHORT,
        temperature=seeded[2],
        top_p=0.9,
        seed=seeded[3],
    )
    assert whole.choices[0].text == tok.decode(expected[seeded[0]][:SHORT])
    assert whole.usage is not None and whole.usage.completion_tokens == SHORT
    after = {w.endpoint: asyncio.run(_wait_idle(w.endpoint)) for w in (prefill, decode)}
    decoded = {e: after[e].decode_tokens - before[e].decode_tokens for e in after}
    prefilled = {e: after[e].prefill_tokens - before[e].prefill_tokens for e in after}
    assert prefilled[prefill.endpoint] >= len(greedy[1]) + len(seeded[1])
    assert decoded[decode.endpoint] >= 2 * (SHORT - 3)  # the decode worker made the streams
    assert decoded[prefill.endpoint] <= 2 * 2  # the prefill worker stopped at the hand-off


def test_split_answer_decodes_on_the_prefill_worker_when_the_decode_worker_lacks_kv(
    served: tuple[LocalFleet, str, str], model_dir: Path
) -> None:
    """The decode worker's KV held all but a few blocks (staged sessions: imported, holding
    KV, never scheduled), so it refuses the hand-over ("KV cache needs N more blocks"). The
    client still gets its whole stream, a direct run's tokens exactly, greedy and seeded;
    the prefill worker decoded it, the decode worker did not."""
    fleet, url, _ = served
    roles = {w.role: w for w in asyncio.run(_serving(fleet))}
    prefill, decode = roles[fpb.WORKER_ROLE_PREFILL], roles[fpb.WORKER_ROLE_DECODE]
    prompt = [(7 * i) % 4000 + 3 for i in range(LONG_PROMPT)]  # more blocks than left free
    greedy = ("kv-greedy", prompt, 0.0, None)
    seeded = ("kv-seeded", prompt, 0.9, 4321)
    reference = asyncio.run(_direct_runs(prefill.endpoint, [greedy, seeded], SHORT))
    tok = ModelTokenizer.load(MODEL, model_dir)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    hogs = asyncio.run(_fill_kv(decode.endpoint, leave_free=KV_LEFT_FREE))
    try:
        free = asyncio.run(_free_blocks(decode.endpoint))
        assert free < -(-LONG_PROMPT // 16), f"the decode worker still has {free} blocks free"
        before = {w.endpoint: asyncio.run(_counters(w.endpoint)) for w in (prefill, decode)}
        streamed = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=SHORT, stream=True, temperature=0
        )
        assert [c.choices[0].text for c in streamed] == deltas(tok, reference["kv-greedy"])
        whole = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=SHORT, temperature=0.9, top_p=0.9, seed=4321
        )
        assert whole.choices[0].text == tok.decode(reference["kv-seeded"])
        assert whole.usage is not None and whole.usage.completion_tokens == SHORT
        after = {w.endpoint: asyncio.run(_wait_idle(w.endpoint)) for w in (prefill, decode)}
    finally:
        asyncio.run(_cancel(decode.endpoint, hogs))
    decoded = {e: after[e].decode_tokens - before[e].decode_tokens for e in after}
    assert decoded[decode.endpoint] == 0  # it refused both hand-overs
    assert decoded[prefill.endpoint] >= 2 * (SHORT - 3)  # and the prefill worker decoded them
    assert asyncio.run(_free_blocks(decode.endpoint)) > free  # the test's hogs are gone


def test_split_fallback_routes_afresh_when_neither_worker_of_the_pair_takes_the_session(
    served: tuple[LocalFleet, str, str], model_dir: Path
) -> None:
    """The decode worker lacks KV (as above), and the prefill worker is gone by the time the
    session would come back to it: between its hand-over and the return, a mixed worker
    starts on h100-b and the prefill worker is stopped (a scale-down). The gateway asks Route
    again (a re-route, not counted a second time), which names the mixed worker, and the
    session decodes there: the client gets a direct run's tokens exactly, in order, once.

    The gateway's serving path runs in this process (``upstream.serve``, as the HTTP handler
    calls it) so that the stop can be timed by the hand-over itself: the prefill worker's
    channel starts the mixed worker and stops the prefill worker when it sees the
    ImportSession bringing the session back, then lets that call go to the stopped worker."""
    fleet, _, _ = served
    roles = {w.role: w for w in asyncio.run(_serving(fleet))}
    assert set(roles) == {fpb.WORKER_ROLE_PREFILL, fpb.WORKER_ROLE_DECODE}, roles
    prefill, decode = roles[fpb.WORKER_ROLE_PREFILL], roles[fpb.WORKER_ROLE_DECODE]
    prompt = [(11 * i) % 4000 + 5 for i in range(LONG_PROMPT)]  # more blocks than left free
    seeded = ("kv-reroute", prompt, 0.9, 2468)
    reference = asyncio.run(_direct_runs(prefill.endpoint, [seeded], SHORT))["kv-reroute"]
    hogs = asyncio.run(_fill_kv(decode.endpoint, leave_free=KV_LEFT_FREE))
    before_mix = traffic_requests(fleet)
    try:
        before = asyncio.run(_counters(decode.endpoint))
        served_by = asyncio.run(_rerouted_split(fleet, model_dir, prefill, seeded))
        after = asyncio.run(_wait_idle(decode.endpoint))
    finally:
        asyncio.run(_cancel(decode.endpoint, hogs))
    assert served_by.tokens == reference  # a direct run's tokens, none lost or repeated
    assert served_by.refusals == [
        (decode.endpoint, "RESOURCE_EXHAUSTED"),  # "KV cache needs N more blocks"
        (prefill.endpoint, "UNAVAILABLE"),  # stopped
    ]
    assert after.decode_tokens == before.decode_tokens  # the decode worker never decoded it
    mixed = asyncio.run(_wait_idle(served_by.third.endpoint))
    assert mixed.decode_tokens >= SHORT - 3  # the worker the fresh Route named decoded it
    assert traffic_requests(fleet) == before_mix + 1  # the re-route was not counted again


def test_a_split_answer_whose_prefill_worker_is_gone_is_routed_afresh(
    served: tuple[LocalFleet, str, str], model_dir: Path
) -> None:
    """A split answer names a prefill worker that a move or a scale-down stops before the
    session opens there (the demo saw one such request fail as "daemon unavailable"): the
    worker refuses the opening Generate with UNAVAILABLE, the session never existed there,
    and the gateway asks Route again (a re-route, not counted twice) and serves the request
    on the worker it names: a direct run's tokens exactly, in order, once."""
    fleet, _, _ = served
    prefill, decode = asyncio.run(_split_pool(fleet))
    seeded = ("gone-prefill", [(7 * i) % 4000 + 5 for i in range(40)], 0.9, 1357)
    reference = asyncio.run(_direct_runs(prefill.endpoint, [seeded], SHORT))["gone-prefill"]
    before_mix = traffic_requests(fleet)
    before = asyncio.run(_counters(decode.endpoint))
    served_by = asyncio.run(_rerouted_split(fleet, model_dir, prefill, seeded, on="/Generate"))
    after = asyncio.run(_wait_idle(decode.endpoint))
    assert served_by.tokens == reference
    assert served_by.refusals == [(prefill.endpoint, "UNAVAILABLE")]  # stopped before it opened
    assert after.decode_tokens == before.decode_tokens  # served whole where the Route said
    mixed = asyncio.run(_wait_idle(served_by.third.endpoint))
    assert mixed.decode_tokens >= SHORT - 3  # the worker the fresh Route named served it
    assert traffic_requests(fleet) == before_mix + 1  # the re-route was not counted again


@dataclass
class _Rerouted:
    tokens: list[int]
    refusals: list[tuple[str, str]]  # (endpoint, gRPC status) of each refused hand-over
    third: fpb.WorkerStatus  # the mixed worker started meanwhile


class _ScaleDownBefore:
    """On the prefill worker's channel: before the call to method ``on`` (ImportSession: the
    session coming back to it; Generate: the session opening there), start a mixed worker on
    h100-b and stop the prefill worker, then let the call go on. ``interceptors`` are its two
    faces: a grpc.aio channel files an interceptor under one call kind only."""

    def __init__(self, fleet: LocalFleet, prefill_id: str, on: str) -> None:
        self.fleet, self.prefill_id, self.on = fleet, prefill_id, on
        self.third: fpb.WorkerStatus | None = None

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        scale_down = self._scale_down

        class Unary(grpc.aio.UnaryUnaryClientInterceptor):
            async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
                await scale_down(details)
                return await continuation(details, request)

        class Streamed(grpc.aio.UnaryStreamClientInterceptor):
            async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
                await scale_down(details)
                return await continuation(details, request)

        return [Unary(), Streamed()]

    async def _scale_down(self, details: grpc.aio.ClientCallDetails) -> None:
        method = details.method
        method = method.decode() if isinstance(method, bytes) else method
        if method.endswith(self.on) and self.third is None:
            async with grpc.aio.insecure_channel(self.fleet.daemon_address) as ch:
                ops = pb_grpc.OperationsStub(ch)
                start = pb.StartFleetWorkerRequest(
                    model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name="h100-b"
                )
                self.third = await ops.StartWorker(start, timeout=180)
                deadline = time.monotonic() + 60  # Route knows it from its first heartbeat
                while self.third.worker_id not in {w.worker_id for w in await _serving(self.fleet)}:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
                stop = pb.StopFleetWorkerRequest(worker_id=self.prefill_id)
                await ops.StopWorker(stop, timeout=60)


class _Channels(WorkerChannels):
    """The gateway's channels, the prefill worker's through ``interceptors``."""

    def __init__(self, special: str, interceptors: list[grpc.aio.ClientInterceptor]) -> None:
        super().__init__()
        self.special = grpc.aio.insecure_channel(special, interceptors=interceptors)
        self.special_endpoint = special

    @asynccontextmanager
    async def lend(self, endpoint: str) -> AsyncIterator[grpc.aio.Channel]:
        if endpoint == self.special_endpoint:
            yield self.special
            return
        async with super().lend(endpoint) as ch:
            yield ch

    async def close(self) -> None:
        await self.special.close()
        await super().close()


async def _rerouted_split(
    fleet: LocalFleet,
    model_dir: Path,
    prefill: fpb.WorkerStatus,
    session: tuple[str, list[int], float, int | None],
    on: str = "/ImportSession",
) -> _Rerouted:
    _, prompt, temperature, seed = session
    gen = Generation(
        model=ModelTokenizer.load(MODEL, model_dir),
        prompt=prompt,
        max_tokens=SHORT,
        temperature=temperature,
        top_p=0.9,
        seed=seed,
        stream=True,
        include_usage=False,
    )
    scale_down = _ScaleDownBefore(fleet, prefill.worker_id, on)
    channels = _Channels(prefill.endpoint, scale_down.interceptors())
    refusals: list[tuple[str, str]] = []

    def refused(endpoint: str, err: grpc.aio.AioRpcError) -> None:
        refusals.append((endpoint, err.code().name))

    try:
        async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
            router = Router(daemon, ttl_s=0)  # its own Route: the first call is counted
            sid = f"gw-reroute-{time.time()}"
            tokens = [m.token async for m in serve(router, channels, gen, sid, refused)]
    finally:
        await channels.close()
    assert scale_down.third is not None, f"the prefill worker never saw {on}"
    return _Rerouted(tokens, refusals, scale_down.third)


LONG_PROMPT = 300  # 19 blocks of 16 tokens
KV_LEFT_FREE = 6


async def _direct_runs(
    endpoint: str, sessions: list[tuple[str, list[int], float, int | None]], tokens: int
) -> dict[str, list[int]]:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        return {
            s[0]: [m.token async for m in stub.Generate(request(s, tokens, f"-ref{time.time()}"))]
            for s in sessions
        }


async def _free_blocks(endpoint: str) -> int:
    counters = await _counters(endpoint)
    return counters.kv_blocks_total - counters.kv_blocks_used


async def _fill_kv(endpoint: str, leave_free: int) -> list[str]:
    """Holds all but about ``leave_free`` of a worker's KV blocks: each hog is a session
    prefilled there, exported with its KV and imported back staged (holding its blocks,
    never scheduled, so it costs no compute). Returns the hogs' session ids."""
    hogs: list[str] = []
    big = [("grpc.max_receive_message_length", 64 << 20)]  # a hog's KV is ~16 MB
    async with grpc.aio.insecure_channel(endpoint, options=big) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        while (free := await _free_blocks(endpoint)) > leave_free:
            blocks = min(free - leave_free, 120)
            sid = f"kv-hog-{len(hogs)}-{time.time()}"
            hog = wpb.GenerateRequest(
                prompt_tokens=[5] * (blocks * 16 - 4), max_new_tokens=8, session_id=sid
            )
            call = stub.Generate(hog)
            await anext(aiter(call))
            exported = await stub.ExportSession(
                wpb.ExportSessionRequest(session_id=sid, with_kv=True, release=True), timeout=60
            )
            call.cancel()
            await stub.ImportSession(
                wpb.ImportSessionRequest(blob=exported.blob, staged=True), timeout=60
            )
            hogs.append(sid)
    return hogs


async def _cancel(endpoint: str, sessions: list[str]) -> None:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for sid in sessions:
            await stub.CancelSession(wpb.CancelSessionRequest(session_id=sid), timeout=30)


async def _split_pool(fleet: LocalFleet) -> tuple[fpb.WorkerStatus, fpb.WorkerStatus]:
    """Replace the mixed worker by a prefill worker on the H200 and a decode worker on an H100."""
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        ops = pb_grpc.OperationsStub(ch)
        for worker in await _serving(fleet):
            await ops.StopWorker(pb.StopFleetWorkerRequest(worker_id=worker.worker_id), timeout=60)

        async def start(role: fpb.WorkerRole, node: str) -> fpb.WorkerStatus:
            request = pb.StartFleetWorkerRequest(model=MODEL, role=role, node_name=node)
            status: fpb.WorkerStatus = await ops.StartWorker(request, timeout=180)
            return status

        prefill = await start(fpb.WORKER_ROLE_PREFILL, "h200-a")
        decode = await start(fpb.WORKER_ROLE_DECODE, "h100-a")
    deadline = time.monotonic() + 60  # Route knows a worker from its first heartbeat on
    while {w.worker_id for w in await _serving(fleet)} != {prefill.worker_id, decode.worker_id}:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    return prefill, decode


def _route(fleet: LocalFleet) -> ppb.RouteResponse:
    request = ppb.RouteRequest(model=MODEL, prompt_tokens=4, expected_output_tokens=TOKENS)
    request.reroute = True  # a look, not a request: keep it out of the traffic mix
    with grpc.insecure_channel(fleet.daemon_address) as ch:
        routed: ppb.RouteResponse = ppb_grpc.PlacementStub(ch).Route(request, timeout=10)
    return routed


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
