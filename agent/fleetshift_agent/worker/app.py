"""The worker process: build or restore an engine, serve it over gRPC until told to stop.

A worker is ready (health SERVING, port file written) only once its engine is loaded and,
when compiled, warmed up, so the first client never pays for compilation and a supervisor
can time a cold start or a restore from the port file alone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
from pathlib import Path

import torch

from fleetshift_agent.engine import Engine, EngineConfig
from fleetshift_agent.engine.factory import engine_from_dir
from fleetshift_agent.snapshot import open_snapshot
from fleetshift_agent.worker.feeds import Feeds
from fleetshift_agent.worker.runner import EngineRunner
from fleetshift_agent.worker.security_args import add_security_args, security_from_args
from fleetshift_agent.worker.service import ROLES, WorkerServicer, WorkerState
from fleetshift_agent.worker.session_core import binding
from fleetshift_agent.worker.snapshots import declare_gpu, engine_from_snapshot
from fleetshift_common.lifecycle import stop_event, write_port_file
from fleetshift_rpc.server import RunningServer, start_server

log = logging.getLogger("fleetshift.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fleetshift_agent.worker", description=__doc__)
    p.add_argument("--model-dir", type=Path, help="Hugging Face style model directory")
    p.add_argument("--restore-from", type=Path, help="start from this snapshot directory")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--port-file", default="", help="written once the worker serves")
    p.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--role", choices=sorted(ROLES), default="mixed")
    p.add_argument("--model-id", default="", help="default: the model directory's name")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the step functions (default: on for a new worker, as the "
        "snapshot was for a restore; env FLEETSHIFT_COMPILE=0 wins)",
    )
    p.add_argument(
        "--compile-artifacts",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="on restore, load the snapshot's compiled graphs and kernels. Off by default: they "
        "are generated code and torch pickles its cache entries, so turning this on trusts the "
        "snapshot store like code (the SHA-256 check and the identical-platform rule still apply)",
    )
    p.add_argument(
        "--restore-sessions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on restore, resume the snapshot's sessions (--no-restore-sessions: weights and "
        "compiled graphs only; the sessions move one by one)",
    )
    p.add_argument(
        "--declared-gpu",
        default="",
        help="on a CPU, report this GPU product (the node's declared inventory) in the "
        "compatibility key",
    )
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    p.add_argument("--start-paused", action="store_true")
    p.add_argument("--max-message-mb", type=int, default=512)
    add_security_args(p)
    args = p.parse_args(argv)
    if not args.model_dir and not args.restore_from:
        p.error("one of --model-dir or --restore-from is required")
    return args


def build_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    """The engine and, when restored, the snapshot id it came from."""
    if args.restore_from:
        snap = open_snapshot(args.restore_from)
        restored = engine_from_snapshot(
            snap,
            device=args.device,
            compile=args.compile,
            use_artifacts=args.compile_artifacts,
            sessions=args.restore_sessions,
        )
        log.info(
            "restored %d session(s) from %s (KV kept for %d; %s; compiled cache %s)",
            len(restored.report.sessions),
            snap.snapshot_id,
            len(restored.report.kv_restored),
            restored.verdict.describe(),
            "loaded" if restored.report.compiled_artifacts_loaded else "not loaded",
        )
        return restored.engine, snap.snapshot_id
    cfg = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_running=args.max_running,
        max_step_tokens=args.max_step_tokens,
        rows=args.rows,
        compile=args.compile is not False,
        device=args.device,
        dtype=args.dtype,
    )
    return engine_from_dir(args.model_dir, cfg, model_id=args.model_id), ""


async def serve(args: argparse.Namespace) -> None:
    started = time.monotonic()
    security = security_from_args(args)  # before the engine loads
    if args.threads:
        torch.set_num_threads(args.threads)
    declare_gpu(args.declared_gpu)
    engine, restored_from = await asyncio.to_thread(build_engine, args)
    built = time.monotonic()
    if args.warmup and engine.compiled:
        await asyncio.to_thread(engine.warm_up)
    warmed = time.monotonic()
    loop = asyncio.get_running_loop()
    feeds = Feeds()
    for s in engine.live_sessions():
        feeds.create(s.session_id, s.generated, s.prompt_len)
    server_ref: list[RunningServer] = []

    def failed(exc: BaseException) -> None:
        loop.call_soon_threadsafe(feeds.close_all, f"engine failed: {exc!r}")
        if server_ref:
            asyncio.run_coroutine_threadsafe(server_ref[0].set_serving(False), loop)

    runner = EngineRunner(
        engine, lambda events: loop.call_soon_threadsafe(feeds.publish, events), failed
    )
    if args.start_paused:
        runner.set_paused(True)
    state = WorkerState(args.worker_id, ROLES[args.role], restored_from)
    servicer = WorkerServicer(runner, feeds, state, loop)
    server = await start_server(
        args.listen,
        [binding(servicer)],
        args.max_message_mb << 20,
        security.credentials,
        security.interceptors,
    )
    server_ref.append(server)
    runner.start()
    await server.set_serving(True)
    write_port_file(args.port_file, server.port)
    log.info(
        "worker %s ready on port %d in %.2f s (load %.2f s, compile warm-up %.2f s)",
        args.worker_id,
        server.port,
        time.monotonic() - started,
        built - started,
        warmed - built,
    )
    stop = stop_event()
    await stop.wait()
    await server.server.stop(grace=2.0)
    runner.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(parse_args(argv)))
    return 0
