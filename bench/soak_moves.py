"""Soak: moves, snapshots, agent kills and daemon restarts on a live local fleet, for minutes.

Real processes (daemon, three agents with declared H100/H100/H200 inventories, reference-engine
workers of the `small` preset on this CPU). Clients keep sessions streaming throughout with the
session-following client; every ~interval seconds one disruption runs, in rotation: move a
worker (same-model or cross-model), snapshot a worker, SIGKILL an agent (restarted 2 s later),
SIGKILL the daemon (restarted at once). After each, the registry's serving workers must be
exactly the workers running on the agents, each on one node only.

    .venv/bin/python bench/soak_moves.py --minutes 10

Reports sessions started / completed / lost (a session survives when its stream delivers
every index 0..n-1 exactly once and ends finished), disruptions by kind, operations by
outcome, and duplicate-worker checks failed. Target (issue 6): 100 % of sessions survive, no
duplicate worker. Baseline in the same run: the first disruption-free minute's completed
sessions per minute against the whole run's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetshift.v1 import agent_pb2, agent_pb2_grpc, worker_pb2
from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_rpc.sessions import follow_session
from tests.e2e.conftest import NODES, make_fleet

SPEC = {n.name: n for n in NODES}


class Soak:
    def __init__(self, fleet, seconds: float, interval: float) -> None:  # type: ignore[no-untyped-def]
        self.fleet, self.seconds, self.interval = fleet, seconds, interval
        self.sessions = Counter()  # type: ignore[var-annotated]
        self.completed_at: list[float] = []
        self.lost: list[str] = []
        self.disruptions = Counter()  # type: ignore[var-annotated]
        self.outcomes = Counter()  # type: ignore[var-annotated]
        self.duplicate_failures = 0
        self.start = time.monotonic()

    def daemon(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.fleet.daemon_address)

    async def workers(self) -> list[fpb.WorkerStatus]:
        async with self.daemon() as ch:
            listed = await ppb_grpc.PlanningStub(ch).ListWorkers(
                ppb.ListWorkersRequest(), timeout=10
            )
        return [w for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING]

    async def client(self, k: int, end: float) -> None:
        rng = random.Random(k)
        n = 0
        while time.monotonic() < end:
            n += 1
            sid = f"c{k}-{n}"
            tokens = rng.randint(150, 400)
            prompt = [rng.randint(1, 7999) for _ in range(rng.randint(4, 40))]
            request = worker_pb2.GenerateRequest(
                prompt_tokens=prompt, max_new_tokens=tokens, session_id=sid
            )
            try:
                workers = await self.workers()
            except grpc.aio.AioRpcError:  # the daemon is restarting: nothing to route to yet
                self.sessions["not started (daemon unreachable)"] += 1
                await asyncio.sleep(0.5)
                continue
            self.sessions["started"] += 1
            try:
                endpoint = rng.choice(workers).endpoint
                seen, finished = [], False
                async with self.daemon() as ch:
                    async for msg in follow_session(ch, endpoint, request, relocate_timeout_s=180):
                        seen.append(msg.index)
                        finished = msg.finished
                if finished and seen == list(range(tokens)):
                    self.sessions["completed"] += 1
                    self.completed_at.append(time.monotonic() - self.start)
                else:
                    self.lost.append(f"{sid}: {len(seen)}/{tokens} finished={finished}")
            except Exception as err:  # a lost session is the failure this soak counts
                self.lost.append(f"{sid}: {type(err).__name__}: {err}")
            await asyncio.sleep(rng.random())

    async def check_no_duplicates(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                registry = {w.worker_id for w in await self.workers()}
                running: Counter[str] = Counter()
                async with self.daemon() as ch:
                    nodes = await fpb_grpc.FleetOperatorStub(ch).ListNodes(
                        fpb.ListNodesRequest(), timeout=10
                    )
                for node in nodes.nodes:
                    async with grpc.aio.insecure_channel(node.agent_address) as ach:
                        info = await agent_pb2_grpc.AgentServiceStub(ach).GetAgentInfo(
                            agent_pb2.GetAgentInfoRequest(), timeout=10
                        )
                    running.update(
                        w.worker_id for w in info.workers if w.state == fpb.WORKER_STATE_SERVING
                    )
                if registry == set(running) and all(c == 1 for c in running.values()):
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                self.duplicate_failures += 1
                return
            await asyncio.sleep(1)

    async def placed(self) -> list[tuple[fpb.WorkerStatus, fpb.Node]]:
        """Serving workers with the node each runs on."""
        out = []
        async with self.daemon() as ch:
            nodes = await fpb_grpc.FleetOperatorStub(ch).ListNodes(
                fpb.ListNodesRequest(), timeout=10
            )
            planning = ppb_grpc.PlanningStub(ch)
            for node in nodes.nodes:
                listed = await planning.ListWorkers(
                    ppb.ListWorkersRequest(node_name=node.name), timeout=10
                )
                out += [(w, node) for w in listed.workers if w.state == fpb.WORKER_STATE_SERVING]
        return out

    async def move(self, rng: random.Random) -> None:
        worker, node = rng.choice(await self.placed())
        target = rng.choice([n for n in SPEC if n != node.name])
        async with self.daemon() as ch:
            ops = pb_grpc.OperationsStub(ch)
            try:
                op = await ops.MoveWorker(
                    pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target), timeout=30
                )
            except grpc.aio.AioRpcError as err:
                self.outcomes[f"refused ({err.code().name})"] += 1
                return
            async for update in ops.WatchOperation(
                pb.WatchOperationRequest(operation_id=op.id), timeout=600
            ):
                op = update
            self.outcomes[pb.OperationState.Name(op.state)] += 1

    async def snapshot(self, rng: random.Random) -> None:
        worker, node = rng.choice(await self.placed())
        async with grpc.aio.insecure_channel(node.agent_address) as ach:
            await agent_pb2_grpc.AgentServiceStub(ach).SnapshotWorker(
                agent_pb2.SnapshotWorkerRequest(
                    worker_id=worker.worker_id, snapshot_id=f"soak-{int(time.time() * 1000)}"
                ),
                timeout=120,
            )

    async def kill_agent(self, rng: random.Random) -> None:
        name = rng.choice(list(SPEC))
        self.fleet.kill_agent(name)
        await asyncio.sleep(2)
        await asyncio.to_thread(self.fleet.start_agent, SPEC[name], 120)

    async def restart_daemon(self, rng: random.Random) -> None:
        self.fleet.kill_daemon()
        await asyncio.to_thread(self.fleet.start_daemon, 120)

    async def disrupt(self, end: float) -> None:
        rng = random.Random(7)
        actions = [self.move, self.snapshot, self.kill_agent, self.move, self.restart_daemon]
        await asyncio.sleep(60)  # the first minute is the undisturbed baseline
        i = 0
        while time.monotonic() < end - 30:
            action = actions[i % len(actions)]
            i += 1
            try:
                await action(rng)
                self.disruptions[action.__name__] += 1
            except Exception as err:
                self.disruptions[f"{action.__name__} errored: {type(err).__name__}"] += 1
            await self.check_no_duplicates()
            await asyncio.sleep(self.interval)

    async def run(self, clients: int) -> None:
        end = time.monotonic() + self.seconds
        async with self.daemon() as ch:
            ops = pb_grpc.OperationsStub(ch)
            for node in ("h100-a", "h200-a"):
                await ops.StartWorker(
                    pb.StartFleetWorkerRequest(
                        model="small", role=fpb.WORKER_ROLE_MIXED, node_name=node
                    ),
                    timeout=300,
                )
        await asyncio.gather(self.disrupt(end), *(self.client(k, end) for k in range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--interval", type=float, default=15.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model"
        make_model(["--out", str(model), "--preset", "small", "--seed", "3"])
        fleet = make_fleet(tmp / "fleet", model)
        fleet.start(timeout_s=180)
        soak = Soak(fleet, args.minutes * 60, args.interval)
        try:
            asyncio.run(soak.run(args.clients))
        finally:
            fleet.stop()
    total = soak.sessions["started"]
    done = soak.sessions["completed"]
    first_minute = sum(1 for t in soak.completed_at if t <= 60)
    print(f"minutes={args.minutes} clients={args.clients} interval={args.interval}s")
    print(
        f"sessions started {total}, completed {done}, lost {len(soak.lost)} -> survived {done / max(total - 0, 1):.1%} (sessions still running at the end count as started)"
    )
    for line in soak.lost[:20]:
        print("  lost:", line)
    print("disruptions:", dict(soak.disruptions))
    print("move operations:", dict(soak.outcomes))
    print("duplicate/registry checks failed:", soak.duplicate_failures)
    print(
        f"completed sessions per minute: first (undisturbed) minute {first_minute}, whole run {done / args.minutes:.1f}"
    )


if __name__ == "__main__":
    main()
