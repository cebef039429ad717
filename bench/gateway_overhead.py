"""What the OpenAI gateway adds: TTFT and tokens/s through it against the same worker called
directly over gRPC, in the same run.

A local fleet (a daemon, one agent with a declared H100, one reference-engine worker of a
locally made model) and a gateway process. Each round sends one request straight to the
worker's Generate and one through the gateway (raw SSE over HTTP with httpx, so the
openai SDK's own parsing is not charged to the gateway), alternating so both see the same
machine load. Through the gateway a request also pays its Route call, its prompt's
tokenizing and its detokenizing: that is the overhead being measured.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/gateway_overhead.py --preset tiny --rounds 30

``--block N`` sends N requests in a row to each path per round: a gateway keeps a Route
answer for ``--route-cache-s`` (0.5 s), so one request per round (over 0.5 s apart) never
starts on a kept one, and a block shows a gateway with a steady stream of requests. Each
gateway answer's ``server-timing`` header gives the gateway's own time to the first token
(reading the request, its route) apart from the worker's, reported beside the end-to-end
figures, with a bare Route call and a bare HTTP round trip (``GET /health``).
``--no-cache-variant`` adds the current gateway with ``--route-cache-s 0``.
``--baseline-src DIR`` adds a third path, a gateway run from another source tree (``git
archive main gateway common proto | tar -x -C DIR``), so a change's before and after are
measured in the same run; ``--profile-gateway FILE`` runs the current one under cProfile.

``--raw-client`` also streams through each gateway with a minimal HTTP/1.1 client (one kept
connection, one write per request, no response objects) and ``--openai-client`` with the
official client: the HTTP client's own cost, which the direct gRPC baseline does not pay,
told apart from the gateway's. ``--token`` runs every gateway with a bearer token.

Targets (issue 15): <= 2 ms added to TTFT at p50, <= 3 % fewer tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import httpx
import numpy as np
import openai

from bench.gateway_fleet import (
    MODEL,
    BenchFleet,
    add_fleet_arguments,
    bench_prompt,
    fleet_for,
    load_average,
)
from fleetshift.v1 import placement_pb2, placement_pb2_grpc, worker_pb2, worker_pb2_grpc


async def direct(stub: worker_pb2_grpc.WorkerServiceStub, prompt: list[int], n: int, i: int):  # type: ignore[no-untyped-def]
    req = worker_pb2.GenerateRequest(
        prompt_tokens=prompt,
        max_new_tokens=n,
        sampling=worker_pb2.WorkerSampling(temperature=0.0),
        session_id=f"direct-{i}",
    )
    start, first, count = time.perf_counter(), 0.0, 0
    async for _ in stub.Generate(req):
        count += 1
        first = first or time.perf_counter()
    return first - start, count / (time.perf_counter() - first) if count > 1 else 0.0


KEPT_BELOW_MS = 0.5  # a route this quick was a kept answer (~0.1 ms); a Route call is ~2 ms here
SPENT: dict[str, list[dict[str, float]]] = {}  # per gateway path: its Server-Timing figures
HEADERS_AT: dict[str, list[float]] = {}  # per gateway path: s until httpx had the headers


def server_timing(header: str) -> dict[str, float]:
    """``read;dur=0.3, route;dur=0.07, upstream;dur=9.8, total;dur=10.2`` as {name: ms}."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


async def through(client: httpx.AsyncClient, url: str, prompt: list[int], n: int, path: str = ""):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    start, first, count = time.perf_counter(), 0.0, 0
    async with client.stream("POST", url + "/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        if path:
            HEADERS_AT.setdefault(path, []).append(time.perf_counter() - start)
        if "server-timing" in reply.headers:  # a gateway from before it sends none
            SPENT.setdefault(path, []).append(server_timing(reply.headers["server-timing"]))
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            json.loads(line[6:])
            count += 1
            first = first or time.perf_counter()
    return first - start, count / (time.perf_counter() - first) if count > 1 else 0.0


class RawHttp:
    """A minimal HTTP/1.1 client on one kept-alive connection (asyncio streams, no parsing
    beyond what the gateway's answers need): the client side's own cost taken out, so what
    remains of an HTTP path is the round trip and the server. httpx parses in pure Python
    (h11) and builds a request and response object per call; openai's client adds more."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        host, _, rest = url.removeprefix("http://").partition("/")
        self.host, self.port = host.rsplit(":", 1)
        self.prefix = "/" + rest
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        """(Re)connect before the clock starts: uvicorn closes a connection idle for 5 s."""
        if self.writer is None or self.reader is None or self.reader.at_eof():
            if self.writer is not None:
                self.writer.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))

    async def _send(self, head: str, body: bytes = b"") -> asyncio.StreamReader:
        assert self.reader is not None and self.writer is not None
        self.writer.write(head.encode() + body)
        return self.reader

    async def _headers(self, reader: asyncio.StreamReader) -> dict[str, str]:
        status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 200"), status
        headers = {}
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        return headers

    async def health(self) -> float:
        await self._connect()
        start = time.perf_counter()
        reader = await self._send(f"GET /health HTTP/1.1\r\nhost: {self.host}\r\n\r\n")
        headers = await self._headers(reader)
        await reader.readexactly(int(headers["content-length"]))
        return time.perf_counter() - start

    async def stream(self, prompt: list[int], n: int, path: str = "") -> tuple[float, float]:
        body = json.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        ).encode()
        head = (
            f"POST {self.prefix}/completions HTTP/1.1\r\nhost: {self.host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n{self.extra}\r\n"
        )
        await self._connect()
        start, first, count = time.perf_counter(), 0.0, 0
        reader = await self._send(head, body)
        headers = await self._headers(reader)
        assert headers.get("transfer-encoding") == "chunked", headers
        if path:
            SPENT.setdefault(path, []).append(server_timing(headers["server-timing"]))
        while True:
            size = int(await reader.readline(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            for event in chunk.split(b"\n\n"):
                if event.startswith(b"data: {"):
                    count += 1
                    first = first or time.perf_counter()
        return first - start, count / (time.perf_counter() - first) if count > 1 else 0.0

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def via_openai(client: openai.AsyncOpenAI, prompt: list[int], n: int):  # type: ignore[no-untyped-def]
    """What an application sees: the official client's streamed completion."""
    start, first, count = time.perf_counter(), 0.0, 0
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True
    )
    async for _ in stream:
        count += 1
        first = first or time.perf_counter()
    return first - start, count / (time.perf_counter() - first) if count > 1 else 0.0


async def health(client: httpx.AsyncClient, url: str) -> float:
    """One ``GET /health`` round trip to the gateway: the bare HTTP hop (uvicorn, Starlette,
    the client's own request and response handling), the floor under any HTTP gateway."""
    start = time.perf_counter()
    reply = await client.get(url.removesuffix("/v1") + "/health")
    assert reply.status_code == 200, reply.text
    return time.perf_counter() - start


async def route(stub: placement_pb2_grpc.PlacementStub, prompt: list[int], n: int) -> float:
    """One bare Route call, as the gateway makes it (marked a re-route, so the traffic mix
    is not charged twice): the daemon hop inside the gateway's added TTFT."""
    req = placement_pb2.RouteRequest(
        model=MODEL, prompt_tokens=len(prompt), expected_output_tokens=n, reroute=True
    )
    start = time.perf_counter()
    await stub.Route(req, timeout=10)
    return time.perf_counter() - start


async def measure(bench: BenchFleet, args: argparse.Namespace) -> None:
    prompt = bench_prompt(args.prompt_tokens)
    rows: dict[str, list[tuple[float, float]]] = {"direct": []}
    rows.update({f"gateway ({name})": [] for name in bench.gateways})
    if args.raw_client:
        rows.update({f"raw ({name})": [] for name in bench.gateways})
    if args.openai_client:
        rows.update({f"openai ({name})": [] for name in bench.gateways})
    sdks = {
        name: openai.AsyncOpenAI(base_url=gw.url, api_key=bench.token or "unused", max_retries=0)
        for name, gw in bench.gateways.items()
    }
    routes: list[float] = []
    hops: list[float] = []
    raw_hops: list[float] = []
    raws = {name: RawHttp(gw.url, bench.auth()) for name, gw in bench.gateways.items()}
    async with (
        grpc.aio.insecure_channel(bench.worker) as ch,
        grpc.aio.insecure_channel(bench.fleet.daemon_address) as daemon,
        httpx.AsyncClient(timeout=300, headers=bench.auth()) as client,
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        placement = placement_pb2_grpc.PlacementStub(daemon)
        for i in range(args.warmup + args.rounds):
            took = await route(placement, prompt, args.max_tokens)
            hop = await health(client, bench.gateways["current"].url)
            raw_hop = await raws["current"].health()
            if i >= args.warmup:
                routes.append(took)
                hops.append(hop)
                raw_hops.append(raw_hop)
            n, tag = args.max_tokens, i >= args.warmup
            results = {
                "direct": [
                    await direct(stub, prompt, n, i * args.block + k) for k in range(args.block)
                ]
            }
            for name, gw in bench.gateways.items():
                results[f"gateway ({name})"] = [
                    await through(client, gw.url, prompt, n, name if tag else "")
                    for _ in range(args.block)
                ]
                if args.raw_client:
                    results[f"raw ({name})"] = [
                        await raws[name].stream(prompt, n, f"raw {name}" if tag else "")
                        for _ in range(args.block)
                    ]
                if args.openai_client:
                    results[f"openai ({name})"] = [
                        await via_openai(sdks[name], prompt, n) for _ in range(args.block)
                    ]
            if tag:
                for path, values in results.items():
                    rows[path].extend(values)
    report(rows, args)
    print(
        f"a bare Route call to the daemon (part of every gateway request's TTFT): p50 "
        f"{np.median(routes) * 1e3:.2f} ms, p90 {np.percentile(routes, 90) * 1e3:.2f} ms"
    )
    for name, spent in SPENT.items():
        if not name:
            continue  # warm-up rounds
        route_ms = np.median([x["route"] for x in spent])
        own = np.median([x["total"] - x["upstream"] for x in spent])
        kept = np.mean([x["route"] < KEPT_BELOW_MS for x in spent]) * 100
        print(
            f"inside gateway ({name}), from its Server-Timing: route p50 {route_ms:.3f} ms "
            f"({kept:.0f} % of requests under {KEPT_BELOW_MS} ms: started on a kept answer); "
            f"read p50 {np.median([x['read'] for x in spent]):.3f} ms; its own time to the "
            f"first token (total - upstream) p50 {own:.3f} ms; upstream (the worker's "
            f"first token) p50 {np.median([x['upstream'] for x in spent]):.3f} ms"
        )
        if name in HEADERS_AT:
            print(f"  httpx had the response headers (sent with the first token) at p50 "
                  f"{np.median(HEADERS_AT[name]) * 1e3:.2f} ms")  # fmt: skip
    print(
        f"a bare HTTP round trip to the current gateway (GET /health): p50 "
        f"{np.median(hops) * 1e3:.2f} ms, p90 {np.percentile(hops, 90) * 1e3:.2f} ms (httpx); "
        f"{np.median(raw_hops) * 1e3:.2f} ms, p90 {np.percentile(raw_hops, 90) * 1e3:.2f} ms "
        "(a minimal client on one kept connection)"
    )
    for raw in raws.values():
        await raw.close()
    for sdk in sdks.values():
        await sdk.close()


def report(rows: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    print(
        f"preset={args.preset} rounds={args.rounds} block={args.block} "
        f"prompt={args.prompt_tokens} max_tokens={args.max_tokens} (sequential, one request "
        "in flight, paths alternating every block)"
    )
    print(f"{'path':<20}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'tok/s p50':>11}"
          f"{'added p50 ms':>14}{'paired ms':>11}{'tok/s lost':>12}")  # fmt: skip
    base = rows["direct"]
    base_ttft = np.median([v[0] for v in base]) * 1e3
    base_rate = np.median([v[1] for v in base])
    for path, values in rows.items():
        ttft = np.array([v[0] for v in values]) * 1e3
        rate = np.median([v[1] for v in values])
        paired = np.median([g[0] - d[0] for g, d in zip(values, base, strict=True)]) * 1e3
        print(
            f"{path:<20}{np.median(ttft):>13.2f}{np.percentile(ttft, 90):>13.2f}{rate:>11.1f}"
            f"{np.median(ttft) - base_ttft:>14.2f}{paired:>11.2f}"
            f"{(1 - rate / base_rate) * 100:>11.1f}%"
        )
    print("targets: added TTFT p50 <= 2 ms, tokens/s lost <= 3 %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_fleet_arguments(parser)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="requests in a row to each path per round (a gateway keeps a Route answer "
        "--route-cache-s, so its share of requests started on a kept answer grows with this)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--raw-client",
        action="store_true",
        help="also stream through each gateway with a minimal HTTP client (rows 'raw (...)'), "
        "the HTTP client's own cost left out",
    )
    parser.add_argument(
        "--openai-client",
        action="store_true",
        help="also stream through each gateway with the official openai client (rows "
        "'openai (...)'): what an application sees",
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print(load_average(), "(start)")
    with fleet_for(args) as bench:
        asyncio.run(measure(bench, args))
    print(load_average(), "(end)")


if __name__ == "__main__":
    main()
