"""How long vLLM takes to start a request whose context it already holds, by context length.

Why: after a pre-copy (docs/vllm.md) the target's vLLM holds a moved session's KV before the
pause, and the session's start inside the pause computes only the tokens of its last,
partial block (vLLM caches whole blocks: up to 127 tokens at the CPU's 128-token blocks).
What that start costs as the context grows is vLLM's own, not FleetShift's; this bench
measures it so the pause bench's growth with context can be read against it.

One vLLM worker (as the agent starts it: ``python -m fleetshift_agent.vllm_worker``, vLLM's
CPU build from .venv-vllm, the tiny tests/vllm model, float32, eager, one OpenMP thread).
Per context length, ``--prompts`` distinct random prompts; each is sent once to fill the
prefix cache, then ``--repeat`` times more, each time timing the first streamed token:

- straight to vLLM's OpenAI-compatible HTTP API (the baseline: vLLM alone), and
- through the worker's gRPC ``Generate`` (what an import's start goes through).

Prints every sample and the medians, and the median's growth from the shortest context to
the longest for each path.

    .venv/bin/python bench/vllm_cached_start.py [--contexts 256,8192] [--prompts 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_fleet import deadline, machine_load, make_vllm_model, serving_worker
from fleetshift.v1 import worker_pb2 as w
from fleetshift.v1 import worker_pb2_grpc

MODEL_ID = "vllm-bench"  # spawn_worker's --model-id


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


async def http_first_token(client: httpx.AsyncClient, port: int, tokens: list[int]) -> float:
    body = {
        "model": MODEL_ID, "prompt": tokens, "max_tokens": 2, "temperature": 0, "stream": True,
    }  # fmt: skip
    started = time.monotonic()
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with client.stream("POST", url, json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data:"):
                return time.monotonic() - started
    raise RuntimeError("vLLM streamed no token")


async def grpc_first_token(
    stub: worker_pb2_grpc.WorkerServiceStub, tokens: list[int], sid: str
) -> float:
    request = w.GenerateRequest(
        prompt_tokens=tokens, max_new_tokens=2, sampling=w.WorkerSampling(temperature=0.0),
        session_id=sid,
    )  # fmt: skip
    started = time.monotonic()
    call = stub.Generate(request, timeout=120)
    async for _ in call:  # type: ignore[attr-defined]
        took = time.monotonic() - started
        call.cancel()
        return took
    raise RuntimeError("the worker streamed no token")


async def measure(
    grpc_port: int, http_port: int, args: argparse.Namespace
) -> dict[tuple[str, int], list[float]]:
    samples: dict[tuple[str, int], list[float]] = {}
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
        httpx.AsyncClient(timeout=120) as client,
    ):
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        for context in args.contexts:
            for p in range(args.prompts):
                tokens = prompt(context, seed=context * 100 + p)
                await http_first_token(client, http_port, tokens)  # into the prefix cache
                for rep in range(args.repeat):
                    direct = await http_first_token(client, http_port, tokens)
                    worker = await grpc_first_token(stub, tokens, f"cached-{context}-{p}-{rep}")
                    samples.setdefault(("vLLM's HTTP API", context), []).append(direct)
                    samples.setdefault(("the worker's Generate", context), []).append(worker)
    return samples


def report(samples: dict[tuple[str, int], list[float]], contexts: list[int]) -> None:
    print("| path | context (tokens) | first token, median (ms) | each (ms) |")
    print("|---|---|---|---|")
    for (path, context), values in samples.items():
        each = ", ".join(f"{v * 1000:.0f}" for v in values)
        print(f"| {path} | {context} | {statistics.median(values) * 1000:.1f} | {each} |")
    small, large = min(contexts), max(contexts)
    for path in dict.fromkeys(path for path, _ in samples):
        grow = statistics.median(samples[path, large]) - statistics.median(samples[path, small])
        print(f"{path}: median {large} minus median {small} = {grow * 1000:+.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="256,8192", help="prompt lengths (tokens)")
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts per length")
    p.add_argument("--repeat", type=int, default=3, help="timed starts per prompt and path")
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    deadline(args.timeout_s)
    window = max(args.contexts) + 64
    print(f"load before: {machine_load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_vllm_model(root / "model", window)
        engine = {
            "dtype": "float32",
            "max_model_len": window,
            "kv_cache_gib": 1.0,
            "enforce_eager": True,
        }
        with serving_worker(model, root, "worker", engine) as worker:
            samples = asyncio.run(measure(worker.grpc_port, worker.vllm_port, args))
    print(f"load after:  {machine_load()}")
    report(samples, args.contexts)


if __name__ == "__main__":
    main()
