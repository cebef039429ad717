"""The vLLM worker's CPU per token against a scripted vLLM: the shim alone, in seconds.

No vLLM: this process serves vLLM's streaming ``/v1/completions`` wire form (HTTP/1.1,
chunked, one ``data: {json}`` event per ``--per-event`` tokens, ``--gap-ms`` apart) and the
shim (``VllmWorkerServicer`` behind gRPC, the code the vLLM worker runs) runs in a child
process per ``--src`` tree ("here": this one; another: ``git archive BASE agent common proto
| tar -x -C DIR``). Each round streams ``--sessions`` Generate calls of ``--tokens`` through
every shim, alternating their order, and counts the child's CPU seconds from /proc. The
tokens are checked. Against real vLLM, ``bench/vllm_overhead.py`` is the figure of record;
this one is for profiling (``py-spy record --native -p PID``) and quick before/after checks.

    nice -n 10 .venv/bin/python bench/vllm_shim_probe.py --src here --src /tmp/base --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_fleet import machine_load
from fleetshift.v1 import worker_pb2, worker_pb2_grpc

EVENT = (
    '{"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    '"text":" tok","logprobs":null,"finish_reason":%s,"stop_reason":null,"token_ids":[%s],'
    '"prompt_token_ids":null}],"usage":null}'
)
SHIM = """
import asyncio, sys
from fleetshift.v1 import worker_pb2
from fleetshift_agent.vllm_worker.client import VllmClient
from fleetshift_agent.vllm_worker.service import VllmIdentity, VllmWorkerServicer
from fleetshift_agent.worker.session_core import binding
from fleetshift_rpc.server import start_server

async def main():
    client = VllmClient(sys.argv[1], "m")
    key = worker_pb2.WorkerCompatKey()
    servicer = VllmWorkerServicer(client, VllmIdentity("w", "m", key), "mixed")
    server = await start_server("127.0.0.1:0", [binding(servicer)], 64 << 20, None, ())
    await server.set_serving(True)
    print(server.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def token(first: int, k: int) -> int:
    return (first + k) % 500


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: Args) -> None:
    """vLLM's answer to one completion request per connection, as its server frames it."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    body = json.loads(await reader.readexactly(length))
    n, first = int(body["max_tokens"]), int(body["prompt"][-1])
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    writer.write(b"transfer-encoding: chunked\r\n\r\n")
    for at in range(0, n, args.per_event):
        ids = ",".join(str(token(first, k)) for k in range(at, min(n, at + args.per_event)))
        finish = '"length"' if at + args.per_event >= n else "null"
        data = b"data: " + (EVENT % (finish, ids)).encode() + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()
        if at + args.per_event < n:
            await asyncio.sleep(args.gap_ms / 1000)
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    with contextlib.suppress(ConnectionError):  # the shim may have closed after the last token
        await writer.drain()
    writer.close()


class Args(argparse.Namespace):
    src: list[str]
    sessions: int
    tokens: int
    rounds: int
    gap_ms: float
    per_event: int


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_shim(src: str, url: str) -> tuple[subprocess.Popen[bytes], int]:
    env = dict(os.environ)
    if src != "here":
        root = Path(src).resolve()
        env["PYTHONPATH"] = os.pathsep.join(str(root / d) for d in ("agent", "common", "proto"))
    proc = subprocess.Popen([sys.executable, "-c", SHIM, url], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def round_through(port: int, args: Args, tag: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)

        async def one(i: int) -> int:
            request = worker_pb2.GenerateRequest(
                prompt_tokens=[i + 1], max_new_tokens=args.tokens, session_id=f"{tag}-{i}"
            )
            got = [m.token async for m in stub.Generate(request, timeout=300)]
            assert got == [token(i + 1, k) for k in range(args.tokens)], f"{tag}-{i}"
            return len(got)

        return sum(await asyncio.gather(*(one(i) for i in range(args.sessions))))


async def run(args: Args) -> None:
    server = await asyncio.start_server(lambda r, w: answer(r, w, args), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    shims = {src: start_shim(src, url) for src in args.src}
    spent = {src: [0.0, 0] for src in shims}
    try:
        for r in range(args.rounds):
            for src in shims if r % 2 == 0 else list(shims)[::-1]:
                proc, port = shims[src]
                before = cpu_s(proc.pid)
                spent[src][1] += await round_through(port, args, f"r{r}")
                spent[src][0] += cpu_s(proc.pid) - before
    finally:
        for proc, _ in shims.values():
            proc.kill()
        server.close()
        await server.wait_closed()
    print(f"load at the end: {machine_load()}")
    for src, (cpu, tokens) in spent.items():
        print(f"{src}: {cpu / tokens * 1e6:.1f} us of the shim's CPU per token ({tokens} tokens)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--src", action="append", default=[], help='a source tree, or "here"')
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4, help="rounds per shim")
    p.add_argument("--gap-ms", type=float, default=2.0, help="between vLLM's events")
    p.add_argument("--per-event", type=int, default=1, help="tokens per vLLM event")
    args = p.parse_args(namespace=Args())
    args.src = args.src or ["here"]
    print(f"load before: {machine_load()}", flush=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
