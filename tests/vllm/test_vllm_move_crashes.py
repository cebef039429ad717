"""SIGKILL the daemon, the destination agent or the source agent during a move of a vLLM worker.

The failpoints of tests/e2e/test_move_crashes.py (``FLEETSHIFT_FAILPOINTS_FILE``) put each
kill at one phase; vLLM's CPU build starts a server in tens of seconds, so the cases share one
fleet (the daemon, two agents) and one worker, which each case moves from where the last one
left it, and they cover the phases where a vLLM move differs most:

- the daemon dies after the pre-copy (``during:precopied``): every session's KV is staged
  on the target, the source not yet paused; rolled back, the target's staged exports go
  with it;
- the daemon dies after ``sessions_copied``: the target already runs a copy of every session
  (a vLLM import starts its request at once), the source holds the originals; before the
  switch, so the restarted daemon rolls back and the target's copies end with the target;
- the daemon dies after ``source_paused``: the source holds every session, each pre-copied
  and staged on the target, no final delta sent; rolled back, the source resumes them;
- the destination's agent dies inside StartWorker once the new vLLM worker serves, before
  anyone was told: rolled back, and the restarted agent ends the worker nobody owns;
- the source's agent dies after ``target_started``: the sessions move worker to worker, so
  the move completes without it, and the source is stopped once its agent is back;
- the destination's agent dies after ``target_started``: the move completes without it too,
  and its restarted agent registers the worker that now serves the sessions;
- the daemon dies after ``switched``: the restarted daemon completes the move; the sessions
  finish on the target while it is down, and their clients still find them there.

Afterwards: every session's tokens equal an unmoved run's on the same vLLM (none lost, none
duplicated); the sessions were mid-stream when the process died; the operation ended the one
way the recovery rule prescribes; the serving workers in the registry are exactly those the
agents run. The test pauses the source before each move (as tests/vllm/test_vllm_moves.py
does): vLLM finishes these sessions in seconds, far faster than a vLLM target starts here.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_common.failpoints import FILE_ENV
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import follow_session
from tests import crash_checks, fleet_checks
from tests.crash_checks import arm, armed, assert_rolled_back, registered_anew
from tests.fleet_checks import finished
from tests.vllm.conftest import KV_MODEL, KV_STORE, NODES, make_fleet
from tests.vllm.test_vllm_workers import start_worker

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]
SPEC = {n.name: n for n in NODES}
TOKENS = 200
BLOCK = 128  # vLLM's KV block on a CPU: prompts longer than one carry KV through the store
HOLD = 8  # each session waits after this many tokens until the test pauses the worker


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


# Greedy: an unmoved run is the reference (vLLM alone equals it: test_vllm_kv_moves.py).
SESSIONS = [(f"c-{i}", prompt(130 + 30 * i, 40 + i)) for i in range(4)]


def request(sid: str, toks: list[int], hold: int = 0) -> worker_pb2.GenerateRequest:
    """``hold``: the session stops after that many tokens and waits for the test's Pause, so
    the pause finds it mid-stream however far the worker ran ahead of a loaded client (CI
    once saw all four sessions end before the Pause landed)."""
    return worker_pb2.GenerateRequest(
        prompt_tokens=toks,
        max_new_tokens=TOKENS,
        sampling=worker_pb2.WorkerSampling(temperature=0.0),
        session_id=sid,
        hold_after_tokens=hold,
    )


# -- the shared fleet ------------------------------------------------------------------------
@dataclass
class Shared:
    root: Path
    model: Path
    python: str
    fleet: LocalFleet | None = None
    built: int = 0
    reference: dict[str, list[int]] = field(default_factory=dict)

    def get(self) -> LocalFleet:
        if self.fleet is None:
            self.built += 1
            root = self.root / f"fleet-{self.built}"
            env = {FILE_ENV: str(root / "failpoints")}
            self.fleet = make_fleet(root, self.model, self.python, NODES, env=env)
            self.fleet.start(timeout_s=120)
        return self.fleet

    def discard(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory, vllm_model: Path, vllm_python: str
) -> Iterator[Shared]:
    one = Shared(tmp_path_factory.mktemp("vllm-crashes"), vllm_model, vllm_python)
    try:
        yield one
    finally:
        one.discard()


@pytest.fixture
def fleet(shared: Shared, request: pytest.FixtureRequest) -> Iterator[LocalFleet]:
    local = shared.get()
    yield local
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed or armed(local):
        shared.discard()  # a failed case may have left anything behind


# -- one case ----------------------------------------------------------------------------------
@dataclass
class Streams:
    started: asyncio.Event = field(default_factory=asyncio.Event)
    counts: dict[str, int] = field(default_factory=dict)
    open: set[str] = field(default_factory=set)


async def source_and_target(fleet: LocalFleet, shared: Shared) -> tuple[fpb.WorkerStatus, str]:
    """The worker the last case left serving (a new one on cpu-a for the first), the other
    node as the target; the first time, an unmoved run of the sessions is the reference."""
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        workers = list((await fleet_checks.serving(daemon)).values())
        assert len(workers) <= 1, workers
        if workers:
            worker = workers[0]
        else:
            worker = await start_worker(pb_grpc.OperationsStub(daemon), "cpu-a", KV_MODEL)
        if not shared.reference:
            async with grpc.aio.insecure_channel(worker.endpoint) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)

                async def one(sid: str, toks: list[int]) -> list[int]:
                    return [m.token async for m in stub.Generate(request(sid + "-ref", toks))]

                got = await asyncio.gather(*(one(*s) for s in SESSIONS))
            shared.reference = {sid: t for (sid, _), t in zip(SESSIONS, got, strict=True)}
    return worker, "cpu-b" if worker.node_name == "cpu-a" else "cpu-a"


async def move_worker(
    fleet: LocalFleet,
    worker: fpb.WorkerStatus,
    target: str,
    suffix: str,
    when_started: Callable[[Streams], Awaitable[None]],
) -> tuple[pb.Operation, dict[str, list[int]]]:
    """Four sessions stream from ``worker``; it is paused (every session held mid-stream) and
    moved to ``target``; ``when_started`` kills and restarts what the case kills. A move
    rolled back before ``target_started`` never paused the source, so the test's own pause
    is lifted by the test."""
    streams = Streams()
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)

        async def one(sid: str, toks: list[int]) -> tuple[str, list[int]]:
            out: list[int] = []
            streams.open.add(sid)
            async for msg in follow_session(
                daemon, worker.endpoint, request(sid + suffix, toks, hold=HOLD)
            ):
                out.append(msg.token)
                streams.counts[sid] = len(out)
                if len(streams.counts) == len(SESSIONS) and min(streams.counts.values()) >= HOLD:
                    streams.started.set()
            streams.open.discard(sid)
            return sid, out

        task = asyncio.gather(*(one(*s) for s in SESSIONS))
        await asyncio.wait_for(streams.started.wait(), 120)
        async with grpc.aio.insecure_channel(worker.endpoint) as ch:
            src = worker_pb2_grpc.WorkerServiceStub(ch)
            assert (await src.Pause(worker_pb2.WorkerPauseRequest())).paused
            op = await ops.MoveWorker(
                pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target), timeout=30
            )
            await when_started(streams)
            final = await finished(ops, op.id, timeout_s=400)
            if final.steps[0].state == pb.STEP_STATE_ROLLED_BACK:
                await src.Resume(worker_pb2.WorkerResumeRequest())  # the test's own pause
        tokens = dict(await asyncio.wait_for(task, 300))
    return final, tokens


def stored(fleet: LocalFleet) -> list[str]:
    """The exports waiting in the disk connector's store."""
    store = fleet.state_dir / KV_STORE
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


def assert_mid_stream(streams: Streams) -> None:
    assert len(streams.open) == len(SESSIONS), f"sessions had ended: {streams.counts}"


def assert_completed(op: pb.Operation) -> None:
    crash_checks.assert_completed(op)
    step = op.steps[0]
    assert step.kind == pb.STEP_KIND_COLD_START
    # Every session carried, each with its KV (vLLM's external prefix-cache counter grew).
    assert step.sessions_carried == len(SESSIONS), step
    assert step.sessions_kv_restored == len(SESSIONS), step


async def registry_matches_agents(fleet: LocalFleet) -> set[str]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        return await fleet_checks.registry_matches_agents(ch)


async def daemon_crashed(fleet: LocalFleet, streams: Streams) -> None:
    """The daemon SIGKILLed itself at its failpoint; disarmed, it comes back (as systemd)."""
    assert fleet.daemon_proc is not None
    await asyncio.to_thread(fleet.daemon_proc.wait, 600)
    assert fleet.daemon_proc.returncode == -9, "the daemon's failpoint was not reached"
    assert_mid_stream(streams)
    arm(fleet, "")
    fleet.kill_daemon()
    since = time.time()
    await asyncio.to_thread(fleet.start_daemon, 120)
    await crash_checks.heartbeating(fleet, since, SPEC)


@dataclass
class AgentKill:
    """SIGKILL ``node``'s agent once the daemon holds at its ``hold`` failpoint (``marker``),
    then let the daemon go on; the agent comes back 2 s later, as systemd would restart it."""

    fleet: LocalFleet
    node: str
    marker: Path
    restarting: list[asyncio.Task[None]] = field(default_factory=list)

    async def kill(self, streams: Streams) -> None:
        await crash_checks.released(self.marker, timeout_s=600)  # vLLM starts take minutes
        self.fleet.kill_agent(self.node)
        assert_mid_stream(streams)
        arm(self.fleet, "")
        self.marker.unlink()
        self.restarting.append(asyncio.get_running_loop().create_task(self._come_back()))

    async def _come_back(self) -> None:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(self.fleet.start_agent, SPEC[self.node], 120)

    async def back(self) -> None:
        await asyncio.gather(*self.restarting)


# -- the cases, in the order they run on the shared fleet ------------------------------------
async def test_daemon_killed_after_the_sessions_were_copied(
    fleet: LocalFleet, shared: Shared
) -> None:
    """The target runs a copy of every session when the daemon dies: rolled back, the copies
    end with the target, the source resumes each session where it was held."""
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, "after:sessions_copied=crash")

    async def crash(streams: Streams) -> None:
        await daemon_crashed(fleet, streams)

    op, tokens = await move_worker(fleet, worker, target, "-d-copied", crash)
    assert_rolled_back(op, "sessions_copied")
    assert op.steps[0].sessions_carried == len(SESSIONS)  # the copies existed
    assert tokens == shared.reference
    assert await registry_matches_agents(fleet) == {worker.worker_id}


async def test_daemon_killed_after_the_precopy(fleet: LocalFleet, shared: Shared) -> None:
    """The daemon dies once every session's KV was pre-copied and staged on the target
    (loaded into its vLLM), before the source's pause: rolled back from ``target_started``;
    the target is stopped and takes the exports it staged with it (the store is empty), the
    source's sessions go on."""
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, "during:precopied=crash")
    exports: list[list[str]] = []

    async def crash(streams: Streams) -> None:
        assert fleet.daemon_proc is not None
        await asyncio.to_thread(fleet.daemon_proc.wait, 600)
        exports.append(stored(fleet))  # staged, waiting for a final delta that never comes
        await daemon_crashed(fleet, streams)

    op, tokens = await move_worker(fleet, worker, target, "-d-precopied", crash)
    assert_rolled_back(op, "target_started")
    assert len(exports[0]) == len(SESSIONS), exports  # each session's KV was pre-copied
    assert stored(fleet) == []  # gone with the target that staged them
    assert tokens == shared.reference
    assert await registry_matches_agents(fleet) == {worker.worker_id}


async def test_daemon_killed_after_the_source_paused(fleet: LocalFleet, shared: Shared) -> None:
    """The daemon dies with the source paused and every session pre-copied, before any final
    delta: rolled back from ``source_paused``, the source resumes each held session where it
    stood, and the target goes with the exports it staged."""
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, "after:source_paused=crash")

    async def crash(streams: Streams) -> None:
        await daemon_crashed(fleet, streams)

    op, tokens = await move_worker(fleet, worker, target, "-d-paused", crash)
    assert_rolled_back(op, "source_paused")
    assert op.steps[0].sessions_carried == 0  # nothing reached the target for good
    assert stored(fleet) == []
    assert tokens == shared.reference
    assert await registry_matches_agents(fleet) == {worker.worker_id}


async def test_target_agent_killed_inside_start_worker(fleet: LocalFleet, shared: Shared) -> None:
    """The destination's agent dies once the new vLLM worker serves, before it answers:
    StartWorker fails, the step rolls back, and the restarted agent ends the orphan."""
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, "agent:start:serving=crash")
    dying = fleet.agent_procs[target]

    async def agent_comes_back(streams: Streams) -> None:
        await asyncio.to_thread(dying.wait, 600)
        assert dying.returncode == -9, "the agent's failpoint was not reached"
        assert_mid_stream(streams)
        arm(fleet, "")
        await asyncio.to_thread(fleet.start_agent, SPEC[target], 120)

    op, tokens = await move_worker(fleet, worker, target, "-a-start", agent_comes_back)
    assert_rolled_back(op)
    assert tokens == shared.reference
    await registered_anew(fleet, target)
    assert await registry_matches_agents(fleet) == {worker.worker_id}


async def test_source_agent_killed_after_the_target_started(
    fleet: LocalFleet, shared: Shared, tmp_path: Path
) -> None:
    """Sessions move worker to worker, so the move completes without the source's agent; the
    source is stopped once its agent is back (it restarts a little later, as systemd would)."""
    marker = tmp_path / "hold"
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, f"after:target_started=hold:{marker}")
    agent = AgentKill(fleet, worker.node_name, marker)
    op, tokens = await move_worker(fleet, worker, target, "-a-source", agent.kill)
    await agent.back()
    assert_completed(op)
    assert tokens == shared.reference
    await registered_anew(fleet, worker.node_name)
    assert await registry_matches_agents(fleet) == {op.steps[0].new_worker_id}


async def test_target_agent_killed_after_the_target_started(
    fleet: LocalFleet, shared: Shared, tmp_path: Path
) -> None:
    """The destination's agent dies once its new vLLM worker serves: the move talks to the
    workers themselves and completes without it; the worker outlives its agent, and the
    restarted agent (a little later, as systemd) registers it again, sessions and all."""
    marker = tmp_path / "hold"
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, f"after:target_started=hold:{marker}")
    agent = AgentKill(fleet, target, marker)
    op, tokens = await move_worker(fleet, worker, target, "-a-target", agent.kill)
    await agent.back()
    assert_completed(op)
    assert tokens == shared.reference
    await registered_anew(fleet, target)
    assert await registry_matches_agents(fleet) == {op.steps[0].new_worker_id}


async def test_daemon_killed_after_the_switch(fleet: LocalFleet, shared: Shared) -> None:
    """The target owns the sessions when the daemon dies: the restarted daemon completes the
    move, ending the source's held copies; every client re-attaches on the target.

    vLLM finishes these sessions in seconds, so they end on the target while the daemon is
    down and before their clients are back: the restarted daemon, which never saw them end,
    must learn from the target's report of its unread sessions where their tokens are."""
    worker, target = await source_and_target(fleet, shared)
    arm(fleet, "after:switched=crash")

    async def crash(streams: Streams) -> None:
        await daemon_crashed(fleet, streams)

    op, tokens = await move_worker(fleet, worker, target, "-d-switched", crash)
    assert_completed(op)
    assert tokens == shared.reference
    assert await registry_matches_agents(fleet) == {op.steps[0].new_worker_id}
