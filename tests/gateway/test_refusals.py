"""The gateway's refusals, over real HTTP against a real gateway process: each bad request
gets its OpenAI-style error with the right status naming the field, and an unreachable daemon
is a 503 with a clear message (the gateway stays up)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from fleetshift_gateway.errors import from_rpc

from fleetshift_agent.engine.make_model import main as make_model

from .procs import gateway

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("gw")
    assert make_model(["--out", str(root / "model"), "--preset", "tiny"]) == 0
    nobody = f"127.0.0.1:{free_port()}"  # no daemon listens here
    with gateway(root, nobody, MODEL, root / "model", "--max-body-bytes", "4096") as url:
        yield url


def post(base_url: str, path: str, **kw: object) -> httpx.Response:
    return httpx.post(base_url + path, timeout=10, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "hi", "max_tokens": 4}, 404, "model"),
        ({"prompt": "hi", "max_tokens": 4}, 400, "model"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [1] * 600, "max_tokens": 4}, 400, "prompt"),
        ({"model": MODEL, "prompt": [9999], "max_tokens": 4}, 400, "prompt"),
        ({"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ],
)
def test_bad_completion_names_the_field(
    base_url: str, body: dict[str, object], status: int, param: str
) -> None:
    reply = post(base_url, "/completions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert param in error["message"] or status == 404
    assert set(error) == {"message", "type", "param", "code"}
    assert reply.headers["x-request-id"]


def test_bad_chat_names_the_message(base_url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}
    reply = post(base_url, "/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[0].role"
    reply = post(base_url, "/chat/completions", json={"model": MODEL, "messages": []})
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "messages")


def test_malformed_json_wrong_type_and_oversized_body(base_url: str) -> None:
    json_type = {"content-type": "application/json"}
    reply = post(base_url, "/completions", content=b'{"model": ', headers=json_type)
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "body")
    assert "not valid JSON" in reply.json()["error"]["message"]
    reply = post(
        base_url, "/completions", content=b"model=tiny", headers={"content-type": "text/plain"}
    )
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "content-type")
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1}
    reply = post(base_url, "/completions", json=big)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "too_large")
    assert "4096" in reply.json()["error"]["message"]


def test_daemon_down_is_503_and_the_gateway_stays_up(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert caught.value.status_code == 503
    assert "daemon is unavailable" in str(caught.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hello", max_tokens=4)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).json()["status"] == "ok"


def test_bearer_token_is_required_when_configured(tmp_path: Path) -> None:
    assert make_model(["--out", str(tmp_path / "model"), "--preset", "tiny"]) == 0
    (tmp_path / "token").write_text("s3cret\n")
    nobody = f"127.0.0.1:{free_port()}"
    extra = ("--token-file", str(tmp_path / "token"))
    with gateway(tmp_path, nobody, MODEL, tmp_path / "model", *extra) as url:
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert caught.value.status_code == 401
        listed = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).models.list()
        assert [m.id for m in listed] == [MODEL]
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200


def test_metrics_count_requests_and_errors_by_cause(tmp_path: Path) -> None:
    assert make_model(["--out", str(tmp_path / "model"), "--preset", "tiny"]) == 0
    port, nobody = free_port(), f"127.0.0.1:{free_port()}"
    with gateway(tmp_path, nobody, MODEL, tmp_path / "model", "--metrics-port", str(port)) as url:
        for body in ({"model": "nope", "prompt": "x"}, {"model": MODEL, "prompt": "x"}):
            post(url, "/completions", json=body)
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'fleetshift_gateway_errors_total{cause="model_not_found"} 1.0' in scraped
    assert 'fleetshift_gateway_errors_total{cause="unavailable"} 1.0' in scraped
    assert 'requests_total{endpoint="/v1/completions",status="503"} 1.0' in scraped


def test_an_unreachable_peer_after_routing_is_named_the_worker_not_the_daemon() -> None:
    """Once a request's route is known, UNAVAILABLE comes from its worker (or a re-route
    after the worker failed): telling the client "the daemon is unavailable" sent a demo's
    operator looking at a healthy daemon for a worker a move had just stopped."""
    err = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="failed to connect to all addresses; ipv4:127.0.0.1:34821: Connection refused",
    )
    before = from_rpc(err, MODEL)
    after = from_rpc(err, MODEL, routed=True)
    assert (before.status, before.code) == (503, "unavailable")
    assert "daemon is unavailable" in before.message
    assert (after.status, after.code) == (503, "worker_unavailable")
    assert "its worker" in after.message and "127.0.0.1:34821" in after.message
    assert "daemon is unavailable" not in after.message
