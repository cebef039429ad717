"""Client-visible pause of a session move: stop-and-copy vs pre-copy + final delta.

Why: stop-and-copy stops the source for the whole KV (export, transfer, import), so the pause
a client sees grows with its context. A live move copies the KV while the source keeps
decoding and stops it only for the final delta (a few blocks), so the pause should stay flat.
The promise is relative, so both are measured in the same run, on the same two worker
processes, together with the baseline a move without KV pays: recomputing the context.

Per context length, one session (prompt of that length, greedy, decoding) is started on
worker A; a client reads its stream, timing every token. The session is then moved back and
forth between A and B, alternating (a) stop-and-copy (ExportSession with_kv + release, then
ImportSession: today's executor) and (b) pre-copy (ExportSession with_kv while it decodes,
ImportSession staged) + final delta (ExportSession release from_token, ImportSession
delta_for). The pause is the gap between the last token the client got from the source and
the first it gets from the target, re-attaching with Generate(resume_session_id,
resume_from_token) on the target directly (no daemon lookup). For (b) the longest gap
between two tokens while the pre-copy ran is printed too: the source holds its step lock
while it copies the KV out. Baseline: a tokens-only move of the 8k session (the target
recomputes 8,192 tokens of KV before the next token), timed the same way.

Usage: python bench/session_pause.py [--contexts 256,1024,4096,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fleetshift.v1 import worker_pb2, worker_pb2_grpc

SMALL_ROUND = 1  # new tokens a pre-copy round may find and still be the last one
MAX_ROUNDS = 8
STOPPED: list[float] = []  # per live move: release ExportSession sent -> delta imported
NEW_TOKENS = 480  # more than the moves of one context take, even on a busy machine
REPO = Path(__file__).resolve().parents[1]
MSG = 512 << 20
OPTIONS = [("grpc.max_receive_message_length", MSG), ("grpc.max_send_message_length", MSG)]


def make_model(out: Path, positions: int) -> None:
    """The ``small`` preset's shape with room for the longest context."""
    from fleetshift_agent.engine.make_model import PRESETS, random_model
    from fleetshift_agent.engine.weights import save_model_dir

    cfg = dataclasses.replace(PRESETS["small"], max_position_embeddings=positions)
    save_model_dir(random_model(cfg, seed=0), out)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    address: str
    stub: worker_pb2_grpc.WorkerServiceStub | None = None
    channel: grpc.aio.Channel | None = None


def start_worker(model: Path, root: Path, name: str, blocks: int) -> Worker:
    port_file = root / f"{name}.port"
    cmd = [
        sys.executable, "-m", "fleetshift_agent.worker", "--model-dir", str(model),
        "--port-file", str(port_file), "--threads", "1", "--no-compile", "--worker-id", name,
        "--num-blocks", str(blocks), "--max-step-tokens", "512", "--max-message-mb", "512",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (root / f"{name}.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker {name} did not start; see {root / name}.log")
        time.sleep(0.05)
    return Worker(proc, f"127.0.0.1:{int(port_file.read_text())}")


@dataclass
class Client:
    """Follows one session across moves, timing every token it receives."""

    session_id: str
    times: list[float] = field(default_factory=list)
    moved_to: asyncio.Queue[Worker] = field(default_factory=asyncio.Queue)
    pauses: list[float] = field(default_factory=list)  # filled on each re-attach

    async def follow(self, first: Worker, request: worker_pb2.GenerateRequest) -> None:
        worker, req = first, request
        while True:
            assert worker.stub is not None
            try:
                async for msg in worker.stub.Generate(req):
                    if msg.index < len(self.times):
                        continue
                    now = time.perf_counter()
                    if req.resume_session_id and msg.index == req.resume_from_token:
                        self.pauses.append(now - self.times[-1])
                    self.times.append(now)
                    if msg.finished:
                        return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.ABORTED:  # ABORTED: the session moved
                    raise
            worker = await self.moved_to.get()
            req = worker_pb2.GenerateRequest(
                resume_session_id=self.session_id, resume_from_token=len(self.times)
            )

    async def wait_tokens(self, n: int) -> None:
        while len(self.times) < n:
            await asyncio.sleep(0.005)

    def max_gap(self, since: float, until: float) -> float:
        inside = [t for t in self.times if since <= t <= until]
        return max((b - a for a, b in itertools.pairwise(inside)), default=0.0)


async def stop_and_copy(src: Worker, dst: Worker, sid: str, with_kv: bool = True) -> int:
    assert src.stub is not None and dst.stub is not None
    exp = await src.stub.ExportSession(
        worker_pb2.ExportSessionRequest(session_id=sid, with_kv=with_kv, release=True)
    )
    imp = await dst.stub.ImportSession(worker_pb2.ImportSessionRequest(blob=exp.blob))
    assert imp.kv_restored == with_kv, imp.kv_note
    return len(exp.blob)


async def live(
    src: Worker, dst: Worker, sid: str, settle_s: float = 0.0
) -> tuple[int, int, float, float]:
    """Pre-copy rounds while the source decodes, then the final delta.

    Round 1 copies everything; each further round copies what changed during the last one,
    until a round finds at most ``SMALL_ROUND`` new tokens (the source is decoding steadily
    again, as Llumnix stops once the remaining delta is small). Returns (round-1 bytes, final
    delta bytes, start and end of the pre-copy rounds).
    """
    assert src.stub is not None and dst.stub is not None
    t0 = time.perf_counter()
    pre = await src.stub.ExportSession(
        worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True)
    )
    staged = await dst.stub.ImportSession(
        worker_pb2.ImportSessionRequest(blob=pre.blob, staged=True)
    )
    assert staged.staged and staged.kv_restored
    await asyncio.sleep(settle_s)  # optional: let both workers digest the big copy first
    base = pre.tokens
    for _ in range(MAX_ROUNDS):
        more = await src.stub.ExportSession(
            worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True, from_token=base)
        )
        again = await dst.stub.ImportSession(
            worker_pb2.ImportSessionRequest(blob=more.blob, delta_for=sid, staged=True)
        )
        assert again.staged and again.tokens == more.tokens
        grew, base = more.tokens - base, more.tokens
        if grew <= SMALL_ROUND:
            break
    t1 = time.perf_counter()
    delta = await src.stub.ExportSession(
        worker_pb2.ExportSessionRequest(session_id=sid, with_kv=True, release=True, from_token=base)
    )
    imp = await dst.stub.ImportSession(
        worker_pb2.ImportSessionRequest(blob=delta.blob, delta_for=sid)
    )
    assert imp.kv_restored and not imp.staged, imp.kv_note
    STOPPED.append(time.perf_counter() - t1)
    return len(pre.blob), len(delta.blob), t0, t1


@dataclass
class Row:
    context: int
    copy_ms: list[float] = field(default_factory=list)
    live_ms: list[float] = field(default_factory=list)
    tbt_ms: float = 0.0
    full_mb: float = 0.0
    delta_kb: float = 0.0
    precopy_gap_ms: list[float] = field(default_factory=list)
    recompute_ms: float = 0.0
    stopped_ms: list[float] = field(default_factory=list)
    engine_ms: float = 0.0  # in-process: release + delta + apply, no RPC


async def run_context(
    a: Worker, b: Worker, n: int, repeats: int, recompute: bool, settle_s: float
) -> Row:
    sid = f"ctx-{n}"
    prompt = [(i * 7919 + 13) % 8000 for i in range(n)]
    request = worker_pb2.GenerateRequest(
        session_id=sid, prompt_tokens=prompt, max_new_tokens=NEW_TOKENS
    )
    client = Client(sid)
    follower = asyncio.create_task(client.follow(a, request))
    await client.wait_tokens(8)  # prefill done, decoding steadily
    row = Row(n)
    recent = client.times[-6:]
    row.tbt_ms = statistics.median(y - x for x, y in itertools.pairwise(recent)) * 1e3
    here, there = a, b
    plan = ["copy", "live"] * repeats + (["recompute"] if recompute else [])
    for kind in plan:
        await client.wait_tokens(len(client.times) + 3)  # decoding again after the last move
        before = len(client.pauses)
        if kind == "live":
            _, delta_bytes, t0, t1 = await live(here, there, sid, settle_s)
            row.delta_kb = delta_bytes / 1e3
            row.precopy_gap_ms.append(client.max_gap(t0, t1) * 1e3)
            row.stopped_ms.append(STOPPED[-1] * 1e3)
        else:
            size = await stop_and_copy(here, there, sid, with_kv=kind == "copy")
            row.full_mb = size / 1e6 if kind == "copy" else row.full_mb
        client.moved_to.put_nowait(there)
        while len(client.pauses) == before:
            await asyncio.sleep(0.002)
        pause_ms = client.pauses[-1] * 1e3
        if kind == "copy":
            row.copy_ms.append(pause_ms)
        elif kind == "live":
            row.live_ms.append(pause_ms)
        else:
            row.recompute_ms = pause_ms
        here, there = there, here
    assert here.stub is not None
    follower.cancel()  # the client leaves: the worker ends the session and frees its KV
    while sid in (await here.stub.GetInfo(worker_pb2.GetWorkerInfoRequest())).session_ids:
        await asyncio.sleep(0.01)
    return row


def report(rows: list[Row], recompute_ms: float) -> None:
    print(f"{'context':>8} {'TBT ms':>7} {'(a) stop-and-copy ms':>21} {'(b) live ms':>12} "
          f"{'(b) - TBT ms':>13} {'(b) stopped ms':>15} {'engine ms':>10} {'full MB':>8} "
          f"{'delta kB':>9} {'pre-copy gap ms':>16}")  # fmt: skip
    for r in rows:
        live = statistics.median(r.live_ms)
        print(
            f"{r.context:>8} {r.tbt_ms:>7.1f} {statistics.median(r.copy_ms):>21.1f} "
            f"{live:>12.1f} {live - r.tbt_ms:>13.1f} {statistics.median(r.stopped_ms):>15.1f} "
            f"{r.engine_ms:>10.2f} {r.full_mb:>8.1f} {r.delta_kb:>9.1f} "
            f"{max(r.precopy_gap_ms):>16.1f}"
        )
    print(
        "(medians of the repeats; TBT: median gap between tokens before the moves; (b) - TBT: "
        "what the move adds to a normal token gap; stopped: release ExportSession sent -> "
        "delta ImportSession returned, as the mover sees it; engine: the same in one process "
        "without RPC (export delta + release + bytes + apply); pre-copy gap: the longest gap "
        "between tokens while the pre-copy rounds ran)"
    )
    first, last = rows[0], rows[-1]
    live_first, live_last = statistics.median(first.live_ms), statistics.median(last.live_ms)
    print(f"(b) pause {last.context}/{first.context}: {live_last / live_first:.2f}x")
    print(
        f"(a) pause {last.context}/{first.context}: "
        f"{statistics.median(last.copy_ms) / statistics.median(first.copy_ms):.2f}x"
    )
    print(f"recompute {last.context} tokens (tokens-only move): {recompute_ms:.0f} ms")
    print(f"recompute / (b) pause at {last.context}: {recompute_ms / live_last:.0f}x")
    print(f"(a) / (b) pause at {last.context}: {statistics.median(last.copy_ms) / live_last:.1f}x")
    print("all pauses ms:", {r.context: {"a": [round(x, 1) for x in r.copy_ms],
                                         "b": [round(x, 1) for x in r.live_ms]} for r in rows})  # fmt: skip


def engine_stop_ms(model: Path, n: int) -> float:
    """The engine's own share of the stop: export the delta, release, carry bytes, apply."""
    import torch

    from fleetshift_agent.engine import EngineConfig, SamplingParams, SessionExport
    from fleetshift_agent.engine.factory import engine_from_dir

    torch.set_num_threads(1)
    cfg = EngineConfig(num_blocks=n // 16 + 64, compile=False, max_step_tokens=512)
    src, dst = engine_from_dir(model, cfg), engine_from_dir(model, cfg)
    src.add_session("s", [(i * 7919 + 13) % 8000 for i in range(n)], 40, SamplingParams())
    while len(src.get("s").generated) < 2:
        src.step()
    pre = src.export_session("s", with_kv=True)
    dst.import_session(SessionExport.from_bytes(pre.to_bytes()), staged=True)
    src.step()
    t = time.perf_counter()
    delta = src.export_session("s", with_kv=True, from_token=len(pre.description["tokens"]))
    src.cancel("s")
    dst.apply_delta("s", SessionExport.from_bytes(delta.to_bytes()))
    return (time.perf_counter() - t) * 1e3


async def main_async(args: argparse.Namespace) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts)
    extra = NEW_TOKENS
    with tempfile.TemporaryDirectory(prefix="session-pause-") as tmp:
        root = Path(tmp)
        make_model(root / "model", longest + extra + 16)
        blocks = 2 * ((longest + extra) // 16 + 2) + 16  # the session + its staged copy
        workers = [start_worker(root / "model", root, n, blocks) for n in ("a", "b")]
        try:
            for w in workers:
                w.channel = grpc.aio.insecure_channel(w.address, options=OPTIONS)
                w.stub = worker_pb2_grpc.WorkerServiceStub(w.channel)
            rows = []
            recompute_ms = 0.0
            for n in contexts:
                t = time.perf_counter()
                row = await run_context(
                    *workers, n, args.repeats, recompute=n == longest, settle_s=args.settle_ms / 1e3
                )
                recompute_ms = row.recompute_ms or recompute_ms
                row.engine_ms = await asyncio.to_thread(engine_stop_ms, root / "model", n)
                rows.append(row)
                print(f"context {n}: done in {time.perf_counter() - t:.1f} s", flush=True)
            report(rows, recompute_ms)
        finally:
            for w in workers:
                if w.channel is not None:
                    await w.channel.close()
                w.proc.kill()
                w.proc.wait(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", default="256,1024,4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--settle-ms",
        type=float,
        default=0.0,
        help="wait this long after the first pre-copy round before the delta rounds",
    )
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
