"""The one typed client of the vLLM server: token-id completions, metrics, pause/resume.

Tokens go in and come out as ids (``prompt`` as a list of ids, ``return_token_ids``), so
the shim never tokenizes and a session's tokens are exactly vLLM's. The end of sequence is
not special (``ignore_eos``): as with the reference engine, a session ends at its length or
at one of its own stop tokens, so both engines end a session at the same token.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from fleetshift_agent.vllm_worker import sse
from fleetshift_common.errors import FleetShiftError, InvalidArgument, Unavailable

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Completion:
    """What a session asks of vLLM (the whole context so far: prompt + carried tokens)."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    request_id: str = ""
    # vLLM's per-request KV-transfer parameters: FleetShift's disk connector stores or loads
    # a session's KV only for a request that names an export here (kv_store); NIXL's are
    # vLLM's own (do_remote_decode on the source, the parameters it returned on the target).
    kv_transfer_params: dict[str, object] | None = None

    def body(self, model: str) -> dict[str, object]:
        body: dict[str, object] = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": True,
            "skip_special_tokens": False,
            "return_token_ids": True,
            "stream": True,
        }
        if self.kv_transfer_params:
            body["kv_transfer_params"] = dict(self.kv_transfer_params)
        return body


@dataclass(frozen=True)
class Chunk:
    tokens: tuple[int, ...]
    finish_reason: str  # "" while running; "length" | "stop" | "abort" at the end


class VllmClient:
    def __init__(self, base_url: str, model: str) -> None:
        self.model = model
        url = urlsplit(base_url)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def stream(self, completion: Completion) -> AsyncIterator[list[Chunk]]:
        """The completion's tokens as vLLM sends them, a batch of chunks per socket read (a
        chunk per vLLM event, in order). A request vLLM refuses (a prompt longer than its
        window, an id outside the vocabulary) is INVALID_ARGUMENT with vLLM's reason, raised
        before the first chunk. Closing the generator closes the connection: vLLM aborts."""
        headers = {"X-Request-Id": completion.request_id} if completion.request_id else {}
        body = json.dumps(completion.body(self.model), separators=(",", ":")).encode()
        request = sse.request_bytes(self._host, self._port, "/v1/completions", body, headers)
        transport, protocol = await sse.open_stream(
            self._host, self._port, request, CONNECT_TIMEOUT_S
        )
        try:
            if protocol.status != 200:
                async for _ in sse.payloads(protocol):
                    pass  # a refusal's body is kept whole (error_body)
                raise _refusal(protocol.status, protocol.error_body.decode(errors="replace"))
            async for batch in sse.payloads(protocol):
                chunks = [c for c in map(_parse_event, batch) if c is not None]
                if chunks:
                    yield chunks
        finally:
            transport.close()

    async def prefill_for_transfer(self, completion: Completion) -> dict[str, object]:
        """Run ``completion`` (a one-token prefill asking ``do_remote_decode``) unstreamed and
        return the ``kv_transfer_params`` vLLM answers with: where another vLLM pulls the
        request's KV blocks from (NIXL), which this vLLM keeps for it until pulled or until
        its own timeout. vLLM returns them only in an unstreamed answer."""
        body = {**completion.body(self.model), "stream": False}
        headers = {"X-Request-Id": completion.request_id} if completion.request_id else {}
        try:
            resp = await self._http.post("/v1/completions", json=body, headers=headers)
        except httpx.HTTPError as err:
            raise Unavailable(f"vLLM server unreachable (KV export): {err!r}") from None
        if resp.status_code != 200:
            raise _refusal(resp.status_code, resp.text)
        params = resp.json().get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise Unavailable(f"vLLM returned no KV transfer parameters (got {params!r})")
        return params

    async def metrics(self) -> str:
        return await self._text("GET", "/metrics")

    async def pause(self) -> None:
        """Freeze running requests where they stand (``mode=keep``): the default, ``abort``,
        would end every session."""
        await self._text("POST", "/pause?mode=keep")

    async def resume(self) -> None:
        await self._text("POST", "/resume")

    async def _text(self, method: str, path: str) -> str:
        try:
            resp = await self._http.request(method, path, timeout=10.0)
        except httpx.HTTPError as err:
            raise Unavailable(f"vLLM server unreachable ({path}): {err!r}") from None
        if resp.status_code != 200:
            raise Unavailable(f"vLLM server answered {resp.status_code} to {path}: {resp.text}")
        return resp.text


# The two fields the shim reads from each of vLLM's events. JSON escapes every quote inside a
# string, so neither pattern can match inside the text vLLM sends beside the ids.
_TOKEN_IDS = re.compile(rb'"token_ids":\s*\[([\d,\s]*)\]')
_FINISH = re.compile(rb'"finish_reason":\s*(?:null|"(\w+)")')


def _parse_event(data: bytes) -> Chunk | None:
    """One SSE ``data:`` payload of vLLM's completion stream (``[DONE]`` already dropped).

    An event with exactly one ``token_ids`` list and one ``finish_reason`` (one choice: the
    shim asks for one) is read by two patterns, a few times cheaper than decoding the whole
    event per token; anything else (an error, no choice, several) is decoded as JSON."""
    ids, finish = _TOKEN_IDS.findall(data), _FINISH.findall(data)
    if len(ids) == 1 and len(finish) == 1:
        tokens = tuple(map(int, ids[0].split(b","))) if ids[0].strip() else ()
        return Chunk(tokens, finish[0].decode())
    return _parse_json(data)


def _parse_json(data: bytes) -> Chunk | None:
    event = json.loads(data)
    if "error" in event:
        raise Unavailable(f"vLLM failed the request: {event['error']}")
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    return Chunk(tuple(choice.get("token_ids") or ()), choice.get("finish_reason") or "")


def _refusal(status: int, body: str) -> FleetShiftError:
    try:
        message = json.loads(body).get("error", {}).get("message", body)
    except (ValueError, AttributeError):
        message = body
    if 400 <= status < 500:
        return InvalidArgument(f"vLLM refused the request: {message}", field="prompt_tokens")
    return Unavailable(f"vLLM answered {status}: {message}")
