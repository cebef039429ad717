"""What the HTTP stack costs one server-sent event stream, without a fleet: Starlette's
``StreamingResponse`` against the gateway's ``_EventStream``, each with and without a
``BaseHTTPMiddleware`` in front (what the gateway's bearer check was).

Two uvicorn servers (uvloop, httptools, as ``fleetshift gateway`` runs) serve a 64-event
stream on both routes; one client process sends each route blocks of requests over one kept
connection with a minimal HTTP/1.1 client, alternating, and reads the servers' CPU time
from /proc. Reported per server and route: time to the first event and to the last (p50)
and the server's CPU per request.

    PYTHONPATH=. nice -n 10 .venv/bin/python bench/gateway_stream_probe.py --rounds 30
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

EVENT = b'data: {"id":"cmpl-x","object":"text_completion","choices":[{"index":0,"text":"ab"}]}\n\n'


def app(middleware: bool, events: int) -> Any:
    from fleetshift_gateway.app import _EventStream
    from starlette.applications import Starlette
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(events):
            yield EVENT

    async def starlette(request: Request) -> Response:
        await request.body()
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def gateway(request: Request) -> Response:
        await request.body()
        return _EventStream(stream(), {})

    built = Starlette(
        routes=[
            Route("/starlette", starlette, methods=["POST"]),
            Route("/gateway", gateway, methods=["POST"]),
        ]
    )
    if middleware:

        async def through(request: Request, call_next: Any) -> Response:
            response: Response = await call_next(request)
            return response

        built.add_middleware(BaseHTTPMiddleware, dispatch=through)
    return built


def serve(port: int, middleware: bool, events: int) -> None:
    import uvicorn

    uvicorn.run(
        app(middleware, events),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> tuple[float, float]:  # fmt: skip
    body = b'{"prompt":[1,2,3]}'
    start = time.perf_counter()
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    while (await reader.readline()) != b"\r\n":
        pass
    first = 0.0
    while True:
        size = int(await reader.readline(), 16)
        await reader.readexactly(size + 2)
        first = first or time.perf_counter()
        if size == 0:
            break
    return first - start, time.perf_counter() - start


async def measure(servers: dict[str, tuple[int, int]], args: argparse.Namespace) -> None:
    conns = {
        k: await asyncio.open_connection("127.0.0.1", port) for k, (port, _) in servers.items()
    }
    cases = [(k, path) for k in servers for path in ("/starlette", "/gateway")]
    firsts: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    wholes: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    cpu = dict.fromkeys(cases, 0.0)
    for rnd in range(args.warmup + args.rounds):
        for case in cases:
            server, path = case
            before = cpu_seconds(servers[server][1])
            for _ in range(args.block):
                first, whole = await one(*conns[server], path)
                if rnd >= args.warmup:
                    firsts[case].append(first)
                    wholes[case].append(whole)
            if rnd >= args.warmup:
                cpu[case] += cpu_seconds(servers[server][1]) - before
    print(
        f"{'server':<22}{'response':<12}{'first p50 ms':>14}{'last p50 ms':>13}{'CPU ms/req':>12}"
    )
    for case in cases:
        n = len(firsts[case])
        print(
            f"{case[0]:<22}{case[1].strip('/'):<12}"
            f"{statistics.median(firsts[case]) * 1e3:>14.3f}"
            f"{statistics.median(wholes[case]) * 1e3:>13.3f}{cpu[case] / n * 1e3:>12.3f}"
        )
    for _, writer in conns.values():
        writer.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block", type=int, default=10, help="requests per route per round")
    parser.add_argument("--events", type=int, default=64)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "MIDDLEWARE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1] == "1", args.events)
        return
    print(load_average(), "(start)")
    procs, servers = [], {}
    try:
        for name, mw in (("plain", "0"), ("BaseHTTPMiddleware", "1")):
            port = free_port()
            cmd = [sys.executable, __file__, "--events", str(args.events), "--serve", str(port), mw]
            procs.append(proc := subprocess.Popen(cmd))
            servers[name] = (port, proc.pid)
            deadline = time.monotonic() + 30
            while not listening(port):
                assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
                time.sleep(0.1)
        asyncio.run(measure(servers, args))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    print(load_average(), "(end)")


if __name__ == "__main__":
    main()
