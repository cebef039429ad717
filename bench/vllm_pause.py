"""The pause a client sees when its vLLM session moves, by context length, against recompute.

Issue 16's targets: the pause of a session moved with its KV stays flat across context (the
8k-token pause at most 1.5x the 256-token one) and is at least 10x shorter than recomputing
the 8k context on the destination.

Two vLLM workers (``python -m fleetshift_agent.vllm_worker``, the process the agent starts;
vLLM's CPU build from .venv-vllm; the tiny tests/vllm model with its window raised to the
largest context, float32, eager, one OpenMP thread each), both with FleetShift's disk KV
connector on one store, both declared the same GPU model (so the compatibility key lets KV
travel). Per case, one greedy session streams from the source to a client; once it has
``--before`` tokens the bench moves it as the daemon's executor moves a session once the
target worker serves (the target's start is not inside a session's pause: the executor starts
the target before it pauses the source): ``Pause`` the source, ``ExportSession`` (with or
without KV), ``ImportSession`` on the target (it answers once vLLM gave the first token), and
the client re-attaches on the target at its token index. The pause is the largest gap in the
client's token stream from the Pause on, measured at the client.

Cases, one run, distinct prompts (so no prefix cache helps across cases):
- KV: export ``with_kv``; the target's vLLM loads the context's whole 128-token blocks from
  the store (``kv_restored``, from vLLM's own external prefix-cache counter) and computes the
  tail (stop-and-copy: what a move of a vLLM worker did before 2026-12-05).
- KV pre-copy (what the executor does now, ``_precopy``): the base export ``with_kv`` while
  the session decodes on, a staged import on the target (which loads it into its vLLM),
  catch-up deltas (as the executor: until a round finds at most one new token or carries no
  KV, so one round here), then the Pause and a final delta that carries
  tokens only; the target loads the base's blocks and computes the tokens after them. Its
  largest gap between the base export and the Pause is printed too ("gap in pre-copy"): a
  pre-copy that stalled the stream would hide its pause there.
- recompute (the baseline): export without KV, the token-history path a move takes when the
  KV cannot travel; the target prefills the whole context.
Also printed per case: the session's time to first token on the source (a fresh prefill of
the context) and the median gap between tokens before the move.

Why not MoveWorker through a daemon: each MoveWorker of a vLLM worker starts a new vLLM server
(no snapshot on a CPU), 4 minutes apiece at this machine's load; the moving of sessions is
the same calls in the same order. ``bench/vllm_move_time.py`` runs whole MoveWorkers.

    .venv/bin/python bench/vllm_pause.py [--contexts 256,8192] [--precopy 256,8192]
        [--recompute 256,8192] [--connector disk|nixl] [--repeat 3] [--worker-nice 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vllm_fleet import (
    deadline,
    machine_load,
    make_vllm_model,
    spawn_worker,
    stop_worker,
    wait_worker,
)
from fleetshift.v1 import worker_pb2 as w
from fleetshift.v1 import worker_pb2_grpc

Stub = worker_pb2_grpc.WorkerServiceStub


@dataclass
class Case:
    label: str  # "KV", "KV pre-copy" or "recompute"
    context: int
    rep: int = 0
    ttft_s: float = 0.0
    pause_s: float = 0.0
    gap_before_s: float = 0.0
    pause_rpc_s: float = 0.0  # the Pause call alone
    export_s: float = 0.0
    import_s: float = 0.0
    reattach_s: float = 0.0  # from the import's answer to the first token on the target
    quiet_before_s: float = 0.0  # from the last token before the Pause to the Pause
    note: str = ""
    restored: bool = False
    precopy_gap_s: float = 0.0  # the largest gap between the base export and the Pause


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def read(call: object, stamps: list[float], until: int) -> None:
    """Read a Generate stream, stamping each token, until ``until`` tokens or its end."""
    async for _ in call:  # type: ignore[attr-defined]
        stamps.append(time.monotonic())
        if len(stamps) >= until:
            return


async def run_case(src: Stub, dst: Stub, case: Case, seed: int, args: argparse.Namespace) -> None:
    sid = f"{case.label}-{case.context}-{case.rep}".replace(" ", "-")
    request = w.GenerateRequest(
        prompt_tokens=prompt(case.context, seed),
        # --session-tokens, or as long as the window allows: a session must still be
        # decoding when the move reaches it, however far it runs ahead of a loaded client.
        max_new_tokens=args.session_tokens or args.window - case.context - 8,
        sampling=w.WorkerSampling(temperature=0.0),
        session_id=sid,
    )
    stamps: list[float] = []
    sent = time.monotonic()
    first = src.Generate(request, timeout=600)
    reader = asyncio.create_task(read(first, stamps, args.window))
    while len(stamps) < args.before:
        if reader.done():
            reader.result()
            raise RuntimeError(f"{sid} ended after {len(stamps)} tokens")
        await asyncio.sleep(0.01)
    case.ttft_s = stamps[0] - sent
    base, precopy_at = 0, time.monotonic()
    if case.label == "KV pre-copy":
        base = await precopy(src, dst, sid)
    paused_at = time.monotonic()
    await src.Pause(w.WorkerPauseRequest(), timeout=60)
    pause_done = time.monotonic()
    exp = await src.ExportSession(
        w.ExportSessionRequest(session_id=sid, with_kv=case.label != "recompute", from_token=base),
        timeout=300,
    )
    exported = time.monotonic()
    imp = await dst.ImportSession(
        w.ImportSessionRequest(blob=exp.blob, delta_for=sid if base else ""), timeout=600
    )
    imported = time.monotonic()
    first.cancel()  # the switch: the client leaves the source ...
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await reader
    received = len(stamps)
    resume = w.GenerateRequest(resume_session_id=sid, resume_from_token=received)
    again = dst.Generate(resume, timeout=600)  # ... and re-attaches on the target
    await asyncio.wait_for(read(again, stamps, received + 1), 600)
    case.reattach_s = stamps[received] - imported
    await asyncio.wait_for(read(again, stamps, received + args.after), 600)
    again.cancel()
    for stub in (src, dst):  # the session ends everywhere; the source serves on
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.CancelSession(w.CancelSessionRequest(session_id=sid), timeout=30)
    await src.Resume(w.WorkerResumeRequest(), timeout=60)
    case.pause_rpc_s = pause_done - paused_at
    case.export_s, case.import_s = exported - pause_done, imported - exported
    case.note, case.restored = imp.kv_note, imp.kv_restored
    gaps = [(a, b - a) for a, b in itertools.pairwise(stamps)]
    case.pause_s = max(g for a, g in gaps if a + g >= paused_at)
    case.quiet_before_s = paused_at - max(t for t in stamps if t < paused_at)
    case.gap_before_s = statistics.median(g for a, g in gaps if a + g < precopy_at)
    case.precopy_gap_s = max((g for a, g in gaps if precopy_at <= a + g < paused_at), default=0)


async def precopy(src: Stub, dst: Stub, sid: str, rounds: int = 8) -> int:
    """The executor's pre-copy (``_precopy``), while the session decodes: the base export
    with its KV, staged on the target, then catch-up deltas until one finds at most one new
    token or carries no KV (a vLLM delta on the disk connector: tokens only). Returns the tokens the target holds (the final delta's ``from_token``)."""
    pre = await src.ExportSession(w.ExportSessionRequest(session_id=sid, with_kv=True), timeout=300)
    await dst.ImportSession(w.ImportSessionRequest(blob=pre.blob, staged=True), timeout=300)
    base = pre.tokens
    for _ in range(rounds):
        more = await src.ExportSession(
            w.ExportSessionRequest(session_id=sid, with_kv=True, from_token=base), timeout=300
        )
        await dst.ImportSession(
            w.ImportSessionRequest(blob=more.blob, delta_for=sid, staged=True), timeout=300
        )
        grew, base = more.tokens - base, more.tokens
        if grew <= 1 or not more.kv_included:
            break
    return int(base)


def report(cases: list[Case], load_before: str, load_after: str, ready: list[float]) -> None:
    print(f"\nload before: {load_before}\nload after:  {load_after}")
    print(f"the two vLLM workers served after {ready[0]:.0f} s and {ready[1]:.0f} s")
    print(
        "| case | context (tokens) | client pause (ms) | no token before the Pause (ms) | "
        "Pause call (ms) | export (ms) | import, to vLLM's first token (ms) | re-attach to the "
        "first token (ms) | median gap before (ms) | gap in pre-copy (ms) | TTFT on the "
        "source, fresh prefill (ms) | import's note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        print(
            f"| {c.label} (#{c.rep + 1}) | {c.context} | {c.pause_s * 1000:.0f} | "
            f"{c.quiet_before_s * 1000:.0f} | {c.pause_rpc_s * 1000:.0f} | {c.export_s * 1000:.0f} | {c.import_s * 1000:.0f} | "
            f"{c.reattach_s * 1000:.0f} | {c.gap_before_s * 1000:.1f} | "
            f"{c.precopy_gap_s * 1000:.0f} | {c.ttft_s * 1000:.0f} | {c.note} |"
        )
    print("\nmedians over the repetitions (ms): client pause; gap in pre-copy")
    med: dict[tuple[str, int], float] = {}
    for key in sorted({(c.label, c.context) for c in cases}):
        mine = [c for c in cases if (c.label, c.context) == key]
        med[key] = statistics.median(c.pause_s for c in mine)
        gap = statistics.median(c.precopy_gap_s for c in mine)
        each = ", ".join(f"{c.pause_s * 1000:.0f}" for c in mine)
        print(f"  {key[0]} at {key[1]}: {med[key] * 1000:.0f} (each: {each}); {gap * 1000:.0f}")
    for label in ("KV", "KV pre-copy"):
        kv = [c for c in cases if c.label == label]
        if kv:
            judge(label, kv, med)


def judge(label: str, kv: list[Case], med: dict[tuple[str, int], float]) -> None:
    """Issue 16's two targets for one way of moving the KV, on the median pauses."""
    small, large = min(c.context for c in kv), max(c.context for c in kv)
    flat = med[label, large] / med[label, small]
    print(
        f"\n{label}: flat across context: median pause at {large} / at {small} = "
        f"{flat:.2f}x (target <= 1.5x: {'met' if flat <= 1.5 else 'NOT met'})"
    )
    if ("recompute", large) in med:
        ratio = med["recompute", large] / med[label, large]
        print(
            f"{label}: against recompute at {large}: median recompute pause / KV pause = "
            f"{ratio:.2f}x (target >= 10x: {'met' if ratio >= 10 else 'NOT met'})"
        )
    if not all(c.restored for c in kv):
        print(f"WARNING: a {label} case was not restored by vLLM (see its note): recomputed")


async def run(ports: list[int], cases: list[Case], args: argparse.Namespace) -> None:
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as a,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[1]}") as b,
    ):
        src, dst = Stub(a), Stub(b)
        warm = w.GenerateRequest(prompt_tokens=[1, 2, 3], max_new_tokens=4, session_id="warm")
        for stub in (src, dst):  # first requests pay one-off costs; not measured
            _ = [m async for m in stub.Generate(warm, timeout=300)]
        for seed, case in enumerate(cases, start=100):
            await run_case(src, dst, case, seed, args)
            print(f"done: {case}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="256,8192", help="contexts moved with their KV")
    p.add_argument(
        "--precopy",
        default="256,8192",
        help="contexts pre-copied with their KV (the executor's way)",
    )
    p.add_argument("--recompute", default="256,8192", help="contexts moved as token history")
    p.add_argument(
        "--tokens", type=int, default=2000,
        help="tokens the window leaves past the longest context (at 600, a pre-copied 8k "
        "session sometimes ended before its move on this machine)",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="rounds of every case, interleaved")
    p.add_argument(
        "--session-tokens", type=int, default=0,
        help="each session's length (0: as long as the window allows; a short session may "
        "end before the move reaches it)",
    )  # fmt: skip
    p.add_argument(
        "--worker-nice", type=int, default=10,
        help="the workers' niceness above the client's: a client runs on another host in "
        "production; here it would be starved by vLLM's busy-polling engine processes",
    )  # fmt: skip
    p.add_argument("--before", type=int, default=10, help="tokens read before the move")
    p.add_argument("--after", type=int, default=10, help="tokens read after it")
    p.add_argument("--timeout-s", type=float, default=1500, help="the whole bench's deadline")
    p.add_argument(
        "--connector", choices=("disk", "nixl"), default="disk",
        help="how KV travels: FleetShift's disk connector (a shared store) or vLLM's NIXL",
    )  # fmt: skip
    args = p.parse_args()
    contexts = [int(x) for x in args.contexts.split(",") if x]
    recompute = [int(x) for x in args.recompute.split(",") if x]
    precopied = [int(x) for x in args.precopy.split(",") if x]
    kinds = [("KV", c) for c in contexts] + [("KV pre-copy", c) for c in precopied]
    kinds += [("recompute", c) for c in recompute]
    cases = [Case(label, c, rep) for rep in range(args.repeat) for label, c in kinds]
    deadline(args.timeout_s)
    window = args.window = max(c.context for c in cases) + args.tokens + 8
    load_before = machine_load()
    print(f"load before: {load_before}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_vllm_model(root / "model", window)
        engine: dict[str, object] = {
            "dtype": "float32", "max_model_len": window, "kv_cache_gib": 1.0,
            "enforce_eager": True, "kv_connector": "FleetShiftDiskConnector",
            "kv_connector_path": str(root / "kv-store"),
        }  # fmt: skip
        if args.connector == "nixl":
            engine |= {"kv_connector": "NixlConnector", "kv_connector_path": ""}
        print(f"KV connector: {engine['kv_connector']}", flush=True)
        procs = [
            spawn_worker(model, root, name, engine, nice=args.worker_nice)
            for name in ("src", "dst")
        ]
        workers = []
        try:
            workers = [
                wait_worker(proc, root, name)
                for proc, name in zip(procs, ("src", "dst"), strict=True)
            ]
            asyncio.run(run([x.grpc_port for x in workers], cases, args))
        finally:
            for proc in procs:
                stop_worker(proc)
        report(cases, load_before, machine_load(), [x.ready_s for x in workers])


if __name__ == "__main__":
    main()
