"""What a client on another host does, run inside its own network namespace by the test.

``python -m tests.multihost.client SPEC.json COMMAND`` prints one JSON document: the facts the
test asserts (it runs in the machine's own namespace, which has no route to the lab, so every
call here crosses the lab's bridge). Commands:

* ``ready``: the nodes the daemon lists, their addresses, and whether their heartbeats advance;
* ``moves``: a worker started on the first node, found through Route, an uninterrupted run of
  the sessions, then a warm move to the second node and a cold move to the third while the
  sessions stream, each followed across the move with a router certificate;
* ``probes``: plaintext and wrong-identity calls to everything the nodes and the daemon serve.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import operations_pb2 as opb
from fleetshift.v1 import operations_pb2_grpc as opb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_rpc.security import client_credentials
from fleetshift_rpc.sessions import follow_session
from tests.fleet_checks import SESSIONS, Session, request

Spec = dict[str, Any]


def creds(spec: Spec, kind: str, name: str) -> grpc.ChannelCredentials:
    pki = Path(spec["pki"])
    return client_credentials(
        str(pki / "ca.crt"),
        cert=str(pki / f"{kind}-{name}.crt"),
        key=str(pki / f"{kind}-{name}.key"),
    )


def daemon_channel(spec: Spec, kind: str, name: str) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(spec["daemon"], creds(spec, kind, name))


# --- ready ----------------------------------------------------------------------------------


async def ready(spec: Spec) -> dict[str, Any]:
    async with daemon_channel(spec, "operator", "alice") as ch:
        fleet = fpb_grpc.FleetOperatorStub(ch)
        deadline = time.monotonic() + 90
        while True:
            nodes = (await fleet.ListNodes(fpb.ListNodesRequest(), timeout=5)).nodes
            if len(nodes) == len(spec["nodes"]) and all(
                n.state == fpb.NODE_STATE_READY for n in nodes
            ):
                break
            if time.monotonic() > deadline:
                return {"nodes": {n.name: {"state": n.state} for n in nodes}, "timeout": True}
            await asyncio.sleep(0.2)
        first = {n.name: n.last_heartbeat_at.ToNanoseconds() for n in nodes}
        await asyncio.sleep(3 * spec["heartbeat_interval_s"])
        later = (await fleet.ListNodes(fpb.ListNodesRequest(), timeout=5)).nodes
    return {
        "nodes": {
            n.name: {
                "state": fpb.NodeState.Name(n.state),
                "agent_address": n.agent_address,
                "heartbeat_advanced": n.last_heartbeat_at.ToNanoseconds() > first[n.name],
            }
            for n in later
        }
    }


# --- moves ----------------------------------------------------------------------------------


async def route(spec: Spec, daemon: grpc.aio.Channel) -> ppb.RouteResponse:
    placement = ppb_grpc.PlacementStub(daemon)
    return await placement.Route(
        ppb.RouteRequest(model=spec["model"], prompt_tokens=16, expected_output_tokens=400),
        timeout=10,
    )


async def stream_all(
    daemon: grpc.aio.Channel,
    endpoint: str,
    tokens: int,
    suffix: str,
    router: grpc.ChannelCredentials,
    started: asyncio.Event,
) -> dict[str, list[int]]:
    seen: dict[str, int] = {}

    async def one(session: Session) -> list[int]:
        out: list[int] = []
        req = request(session, tokens, suffix)
        async for msg in follow_session(daemon, endpoint, req, credentials=router):
            out.append(msg.token)
            seen[session[0]] = len(out)
            if len(seen) == len(SESSIONS) and min(seen.values()) >= 20:
                started.set()
        return out

    results = await asyncio.gather(*(one(s) for s in SESSIONS))
    return {s[0]: r for s, r in zip(SESSIONS, results, strict=True)}


async def move_while_streaming(
    spec: Spec, worker_id: str, target: str, suffix: str
) -> dict[str, Any]:
    """Route (as the router), stream every session from this host, move the worker to
    ``target`` (as the operator) once all are mid-stream, and follow them to the end."""
    router = creds(spec, "router", "edge")
    async with (
        daemon_channel(spec, "router", "edge") as as_router,
        daemon_channel(spec, "operator", "alice") as as_operator,
    ):
        routed = await route(spec, as_router)
        started = asyncio.Event()
        streams = asyncio.create_task(
            stream_all(as_router, routed.endpoint, spec["tokens"], suffix, router, started)
        )
        await asyncio.wait_for(started.wait(), 120)
        ops = opb_grpc.OperationsStub(as_operator)
        op = await ops.MoveWorker(
            opb.MoveWorkerRequest(worker_id=worker_id, target_node=target, reason="multihost"),
            timeout=30,
        )
        async for update in ops.WatchOperation(opb.WatchOperationRequest(operation_id=op.id)):
            op = update
        tokens = await asyncio.wait_for(streams, 300)
        after = await route(spec, as_router)
    step = op.steps[0]
    return {
        "routed_endpoint": routed.endpoint,
        "routed_node": routed.node_name,
        "state": opb.OperationState.Name(op.state),
        "error": op.error,
        "step_kind": opb.StepKind.Name(step.kind),
        "phase": step.phase,
        "sessions_carried": step.sessions_carried,
        "new_worker_id": step.new_worker_id,
        "tokens": tokens,
        "routed_after": {"endpoint": after.endpoint, "node": after.node_name},
    }


async def moves(spec: Spec) -> dict[str, Any]:
    first, second, third = spec["move_path"]
    async with daemon_channel(spec, "operator", "alice") as as_operator:
        worker = await opb_grpc.OperationsStub(as_operator).StartWorker(
            opb.StartFleetWorkerRequest(
                model=spec["model"], role=fpb.WORKER_ROLE_MIXED, node_name=first
            ),
            timeout=300,
        )
    async with daemon_channel(spec, "router", "edge") as as_router:
        routed = await route(spec, as_router)
        never = asyncio.Event()
        reference = await asyncio.wait_for(
            stream_all(
                as_router, routed.endpoint, spec["tokens"], "-ref", creds(spec, "router", "edge"),
                never,
            ),
            300,
        )  # fmt: skip
    warm = await move_while_streaming(spec, worker.worker_id, second, "-warm")
    cold = await move_while_streaming(spec, warm["new_worker_id"], third, "-cold")
    return {
        "started": {"worker_id": worker.worker_id, "endpoint": worker.endpoint},
        "reference": reference,
        "warm": warm,
        "cold": cold,
    }


# --- probes ---------------------------------------------------------------------------------


async def outcome(call: Callable[[], Awaitable[Any]]) -> str:
    """'OK' or the status code name a call ended with."""
    try:
        await call()
    except grpc.aio.AioRpcError as err:
        return str(err.code().name)
    return "OK"


async def probe_worker(spec: Spec, endpoint: str, owner: str) -> dict[str, str]:
    pki = Path(spec["pki"])
    other = next(n for n in spec["nodes"] if n != owner)
    dial: dict[str, grpc.ChannelCredentials | None] = {
        "plaintext": None,
        "tls_no_client_cert": grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes()),
        "other_node": creds(spec, "node", other),
        "own_node": creds(spec, "node", owner),
        "router": creds(spec, "router", "edge"),
        "operator": creds(spec, "operator", "alice"),
        "daemon": creds(spec, "daemon", "fleetshiftd"),
    }
    found: dict[str, str] = {}
    for who, credentials in dial.items():
        ch = (
            grpc.aio.insecure_channel(endpoint)
            if credentials is None
            else grpc.aio.secure_channel(endpoint, credentials)
        )
        async with ch:
            calls = await _worker_calls(worker_pb2_grpc.WorkerServiceStub(ch), who)
        found.update({f"{who}:{call}": code for call, code in calls.items()})
    return found


async def _worker_calls(stub: worker_pb2_grpc.WorkerServiceStub, who: str) -> dict[str, str]:
    return {
        "GetInfo": await outcome(
            lambda: stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
        ),
        # A session that cannot exist: an authorized caller gets NOT_FOUND from the worker
        # (nothing is cancelled), a refused one never reaches the servicer.
        "CancelSession": await outcome(
            lambda: stub.CancelSession(
                worker_pb2.CancelSessionRequest(session_id="no-such-session"), timeout=5
            )
        ),
        "Generate": await outcome(
            lambda: _first_token(stub.Generate(request(SESSIONS[0], 1, f"-probe-{who}")))
        ),
    }


async def _first_token(call: Any) -> None:
    async for _ in call:
        return


async def probe_plaintext(address: str, service: str) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        if service == "agent":
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            return await outcome(
                lambda: stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=5)
            )
        fleet = fpb_grpc.FleetOperatorStub(ch)
        return await outcome(lambda: fleet.ListNodes(fpb.ListNodesRequest(), timeout=5))


async def probes(spec: Spec) -> dict[str, Any]:
    async with daemon_channel(spec, "operator", "alice") as ch:
        listed = await ppb_grpc.PlanningStub(ch).ListWorkers(ppb.ListWorkersRequest(), timeout=10)
    workers = {
        w.worker_id: (w.endpoint, w.node_name)
        for w in listed.workers
        if w.state == fpb.WORKER_STATE_SERVING
    }
    return {
        "daemon_plaintext": await probe_plaintext(spec["daemon"], "daemon"),
        "agents_plaintext": {
            name: await probe_plaintext(address, "agent") for name, address in spec["nodes"].items()
        },
        "workers": {
            wid: {"endpoint": ep, "node": node, **await probe_worker(spec, ep, node)}
            for wid, (ep, node) in workers.items()
        },
    }


COMMANDS = {"ready": ready, "moves": moves, "probes": probes}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(asyncio.run(COMMANDS[sys.argv[2]](spec))))


if __name__ == "__main__":
    main()
