"""A vLLM worker on a node whose workers serve mTLS, with real processes throughout.

The daemon, the agent and the vLLM worker's shim all serve mTLS with certificates of one CA
(``LocalFleet(tls=True)``); the daemon starts a vLLM worker on the node as it would a
reference one, Route answers it to a router certificate, and sessions stream from it over
mTLS to that router. The worker applies the reference worker's rules
(tests/agent/test_worker_tls.py): nothing in plaintext, control calls from the daemon and its
own agent only, sessions from the listed callers (``router:*`` by default) only. vLLM's own
HTTP server listens on 127.0.0.1 only, behind the shim. One vLLM start for the whole file.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from fleetshift_rpc.sessions import follow_session
from tests.vllm.conftest import MODEL, SESSIONS, make_fleet, request

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
NODE = NodeSpec("tls-a", "NVIDIA H100 80GB HBM3", 1)
TOKENS = 24
OK, DENIED, FOUND_NONE = (
    grpc.StatusCode.OK,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
)


@pytest.fixture
def tls_fleet(tmp_path: Path, vllm_model: Path, vllm_python: str) -> Iterator[LocalFleet]:
    local = make_fleet(tmp_path / "fleet", vllm_model, vllm_python, (NODE,), tls=True)
    try:
        local.start(timeout_s=120)
        yield local
    finally:
        local.stop()


async def _code(call: Callable[[], Awaitable[Any]]) -> grpc.StatusCode:
    try:
        await call()
    except grpc.aio.AioRpcError as err:
        return err.code()
    return OK


async def _probe(endpoint: str, creds: grpc.ChannelCredentials | None) -> dict[str, Any]:
    """GetInfo, CancelSession and Generate on the worker, in plaintext or as ``creds``."""
    channel = (
        grpc.aio.secure_channel(endpoint, creds) if creds else grpc.aio.insecure_channel(endpoint)
    )
    async with channel as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        async def generate() -> None:
            async for _ in stub.Generate(request("probe", [1, 2, 3], 1), timeout=60):
                return

        cancel = worker_pb2.CancelSessionRequest(session_id="nobody")
        return {
            "GetInfo": await _code(
                lambda: stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)
            ),
            "CancelSession": await _code(lambda: stub.CancelSession(cancel, timeout=10)),
            "Generate": await _code(generate),
        }


def _vllm_http_port(log: Path) -> int:
    found = re.findall(r"vLLM \S+ on 127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
    assert found, f"no vLLM server line in {log}"
    return int(found[-1])


def _listening_hosts(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                hosts.add(host)
    return hosts


async def test_vllm_worker_serves_mtls_with_the_reference_workers_rules(
    tls_fleet: LocalFleet,
) -> None:
    fleet = tls_fleet
    router = fleet.credentials("router", "edge")
    operator = fleet.credentials()
    async with grpc.aio.secure_channel(fleet.daemon_address, operator) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        started = time.monotonic()
        worker = await ops.StartWorker(
            pb.StartFleetWorkerRequest(
                model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name=NODE.name
            ),
            timeout=600,
        )
        print(f"\nvLLM worker on a TLS node serving in {time.monotonic() - started:.1f} s")
        assert worker.state == fpb.WORKER_STATE_SERVING and worker.endpoint

        # A router: Route answers the vLLM worker, and sessions stream from it over mTLS.
        async with grpc.aio.secure_channel(fleet.daemon_address, router) as as_router:
            routed = await ppb_grpc.PlacementStub(as_router).Route(
                ppb.RouteRequest(model=MODEL, prompt_tokens=8, expected_output_tokens=TOKENS),
                timeout=10,
            )
            assert routed.endpoint == worker.endpoint

            async def one(sid: str, prompt: list[int]) -> list[int]:
                req = request(sid, prompt, TOKENS)
                stream = follow_session(as_router, routed.endpoint, req, credentials=router)
                return [m.token async for m in stream]

            streamed = await asyncio.gather(*(one(*s) for s in SESSIONS[:2]))
        assert [len(t) for t in streamed] == [TOKENS, TOKENS]

        # The agent reads the worker over mTLS too: vLLM's counters reach the daemon.
        deadline = time.monotonic() + 30
        while True:
            reply = await ppb_grpc.PlanningStub(daemon).ListWorkers(ppb.ListWorkersRequest())
            (status,) = [w for w in reply.workers if w.worker_id == worker.worker_id]
            if status.counters.decode_tokens >= 2 * TOKENS:
                break
            assert time.monotonic() < deadline, f"counters never arrived: {status.counters}"
            await asyncio.sleep(0.25)

        # Who may call what on the worker's port: the reference worker's matrix.
        probes = {
            "plaintext": await _probe(worker.endpoint, None),
            "daemon": await _probe(worker.endpoint, fleet.credentials("daemon", "fleetshiftd")),
            "own_node": await _probe(worker.endpoint, fleet.credentials("node", NODE.name)),
            "other_node": await _probe(worker.endpoint, fleet.credentials("node", "tls-b")),
            "router": await _probe(worker.endpoint, router),
            "operator": await _probe(worker.endpoint, operator),
        }
        unavailable = grpc.StatusCode.UNAVAILABLE  # the handshake fails: no client certificate
        assert probes["plaintext"] == dict.fromkeys(probes["plaintext"], unavailable)
        assert probes["daemon"] == {"GetInfo": OK, "CancelSession": FOUND_NONE, "Generate": DENIED}
        assert probes["own_node"] == probes["daemon"]
        assert probes["other_node"] == dict.fromkeys(probes["daemon"], DENIED)
        assert probes["router"] == {"GetInfo": DENIED, "CancelSession": DENIED, "Generate": OK}
        assert probes["operator"]["CancelSession"] == DENIED
        assert probes["operator"]["Generate"] == DENIED  # not in worker_session_callers

        # vLLM's own HTTP server: loopback only, behind the shim.
        log = fleet.state_dir / f"agent-{NODE.name}" / "workers" / f"{worker.worker_id}.log"
        hosts = _listening_hosts(_vllm_http_port(log))
        assert hosts and hosts <= {"0100007F", "0000000000000000FFFF00000100007F"}, hosts

        await ops.StopWorker(pb.StopFleetWorkerRequest(worker_id=worker.worker_id), timeout=60)
