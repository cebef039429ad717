"""SIGKILL the daemon, the source agent or the destination agent at a step of a move.

Failpoints (``FLEETSHIFT_FAILPOINTS``) put the kill exactly at a phase of the daemon's
executor (``after:<phase>``), or inside an agent's handler while the daemon's call to it is in
flight (``agent:snapshot:written``, ``agent:fetch:received``, ``agent:start:serving``,
``agent:stop:stopped``). Every phase of a warm move, of a cold move and of a retirement is
covered, and the daemon also dies while an agent call of a cold move is in flight, on either
side of the switch (role changes and starts have no phase between ``planned`` and ``done``;
the kill inside an agent's StartWorker is the cold move's).

Afterwards: every session's token stream equals an uninterrupted run (none lost, none
duplicated), the sessions were still streaming when the process died (the race happened), the
workers the registry says serve are exactly the ones running on the agents, and the operation
went the one way the recovery rule prescribes for that point: rolled back before ``switched``,
completed from it on.

The cases share one fleet (daemon, three agents) and, where it stands on a suitable node, the
worker the previous case left serving; a case arms its failpoints in the running processes
(``FLEETSHIFT_FAILPOINTS_FILE``) and disarms them before anything restarts. A case that fails
discards the fleet, so the next starts clean.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift_common.failpoints import FILE_ENV
from fleetshift_daemon.localfleet import LocalFleet
from fleetshift_rpc.sessions import follow_session
from tests import fleet_checks
from tests.crash_checks import (
    arm,
    armed,
    assert_completed,
    assert_rolled_back,
    heartbeating,
    registered_anew,
    released,
)
from tests.e2e.conftest import MODEL, NODES, SESSIONS, make_fleet, request
from tests.fleet_checks import finished

# Slow: a case runs real processes through a move and restarts; on a loaded 2-core machine one
# takes minutes (the first also starts the shared fleet), hence the longer per-test timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SPEC = {n.name: n for n in NODES}
H100 = ("h100-a", "h100-b")
H200 = "h200-a"
# Long enough to be mid-stream through a whole move on a loaded machine, and no longer: the
# time after the move is spent only to compare the rest of each stream.
TOKENS = 400
# A retirement needs the planner to want fewer workers (no traffic: it wants none, and keeps
# the model's last one), and may drain for a while.
RETIRING = "[planner]\ninterval_s = 0\nretire_surplus = true\ndrain_timeout_s = 150\n"


# -- the shared fleet ------------------------------------------------------------------------
@dataclass
class SharedFleet:
    root: Path
    model_dir: Path
    fleet: LocalFleet | None = None
    built: int = 0

    def get(self) -> LocalFleet:
        if self.fleet is None:
            self.built += 1
            root = self.root / f"fleet-{self.built}"
            points = root / "failpoints"
            self.fleet = make_fleet(
                root, self.model_dir, planner=RETIRING, env={FILE_ENV: str(points)}
            )
            self.fleet.start(timeout_s=120)
        return self.fleet

    def discard(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None


@pytest.fixture(scope="module")
def shared_fleet(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[SharedFleet]:
    shared = SharedFleet(tmp_path_factory.mktemp("crashes"), model_dir)
    try:
        yield shared
    finally:
        shared.discard()


@pytest.fixture
def fleet(shared_fleet: SharedFleet, request: pytest.FixtureRequest) -> Iterator[LocalFleet]:
    local = shared_fleet.get()
    yield local
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed or armed(local):
        shared_fleet.discard()  # a failed case may have left anything behind


# -- what every case observes ------------------------------------------------------------------
Followed = tuple[str, tuple, str]  # type: ignore[type-arg]  # endpoint, session, id suffix


@dataclass
class Streams:
    """Sessions followed through the daemon (``LocateSession``) as a client would, by id."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    counts: dict[str, int] = field(default_factory=dict)
    open: set[str] = field(default_factory=set)
    task: asyncio.Task[dict[str, list[int]]] | None = None

    def follow(self, daemon: grpc.aio.Channel, sessions: list[Followed]) -> None:
        async def one(endpoint: str, session: tuple, suffix: str) -> tuple[str, list[int]]:  # type: ignore[type-arg]
            sid, tokens = session[0] + suffix, []
            self.open.add(sid)
            async for msg in follow_session(daemon, endpoint, request(session, TOKENS, suffix)):
                tokens.append(msg.token)
                self.counts[sid] = len(tokens)
                if len(self.counts) == len(sessions) and min(self.counts.values()) >= 20:
                    self.started.set()
            self.open.discard(sid)
            return sid, tokens

        async def every() -> dict[str, list[int]]:
            return dict(await asyncio.gather(*(one(*s) for s in sessions)))

        self.task = asyncio.create_task(every())

    async def tokens(self) -> dict[str, list[int]]:
        assert self.task is not None
        return await asyncio.wait_for(self.task, 300)


async def serving(fleet: LocalFleet) -> dict[str, fpb.WorkerStatus]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        return await fleet_checks.serving(ch)


async def registry_matches_agents(fleet: LocalFleet) -> set[str]:
    """The serving workers in the registry are exactly those running on the agents."""
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        return await fleet_checks.registry_matches_agents(ch)


# -- setting a case up ---------------------------------------------------------------------------
async def start_worker(ops: pb_grpc.OperationsStub, node: str) -> fpb.WorkerStatus:
    return await ops.StartWorker(
        pb.StartFleetWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_MIXED, node_name=node),
        timeout=180,
    )


async def source_for(fleet: LocalFleet, warm: bool) -> tuple[fpb.WorkerStatus, str]:
    """One serving worker to move and the node to move it to: the worker the last case left,
    where a move of the wanted kind can start from its node, else a new one on h100-a."""
    async with grpc.aio.insecure_channel(fleet.daemon_address) as ch:
        ops = pb_grpc.OperationsStub(ch)
        workers = list((await serving(fleet)).values())
        keep = next(
            (w for w in workers if w.node_name in H100 or (not warm and w.node_name == H200)), None
        )
        for w in workers:
            if w is not keep:
                await ops.StopWorker(pb.StopFleetWorkerRequest(worker_id=w.worker_id), timeout=60)
        if keep is None:
            keep = await start_worker(ops, H100[0])
    if warm:
        target = H100[1] if keep.node_name == H100[0] else H100[0]
    else:
        target = H200 if keep.node_name in H100 else H100[0]
    return keep, target


async def move_worker(
    fleet: LocalFleet,
    worker: fpb.WorkerStatus,
    target: str,
    suffix: str,
    when_started: Callable[[Streams], Awaitable[None]],
) -> tuple[pb.Operation, dict[str, list[int]]]:
    """Move ``worker`` while four sessions stream from it; ``when_started`` runs once the move
    was accepted (it kills and restarts what the case kills)."""
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        streams = Streams()
        streams.follow(daemon, [(worker.endpoint, s, suffix) for s in SESSIONS])
        await asyncio.wait_for(streams.started.wait(), 120)
        op = await ops.MoveWorker(
            pb.MoveWorkerRequest(worker_id=worker.worker_id, target_node=target), timeout=30
        )
        await when_started(streams)
        final = await finished(ops, op.id)
        tokens = await streams.tokens()
        return final, {sid.removesuffix(suffix): t for sid, t in tokens.items()}


def assert_mid_stream(streams: Streams) -> None:
    """When the process died, every session was still streaming: the race happened."""
    assert len(streams.open) == len(SESSIONS), f"sessions had ended: {streams.counts}"


async def daemon_crashed(fleet: LocalFleet, streams: Streams) -> None:
    """The daemon SIGKILLed itself at its failpoint; it comes back (as systemd would)."""
    assert fleet.daemon_proc is not None
    await asyncio.to_thread(fleet.daemon_proc.wait, 180)
    assert fleet.daemon_proc.returncode == -9, "the daemon's failpoint was not reached"
    assert_mid_stream(streams)
    await restart_daemon(fleet)


async def restart_daemon(fleet: LocalFleet) -> None:
    """Disarmed, the daemon comes back (as systemd would restart it)."""
    arm(fleet, "")
    fleet.kill_daemon()
    since = time.time()
    await asyncio.to_thread(fleet.start_daemon, 120)
    await heartbeating(fleet, since, SPEC)


# -- the daemon dies at a phase of a move ---------------------------------------------------------
FORWARD = ("switched", "source_retired")  # the target owns the sessions: completed forward
WARM_PHASES = (
    "target_reserved",
    "snapshot_taken",
    "snapshot_fetched",
    "target_started",
    "source_paused",
    "sessions_copied",
    "switched",
    "source_retired",
)
COLD_PHASES = tuple(p for p in WARM_PHASES if not p.startswith("snapshot"))
DAEMON_KILLS = [("warm", p) for p in WARM_PHASES] + [("cold", p) for p in COLD_PHASES]


@pytest.mark.parametrize(("kind", "phase"), DAEMON_KILLS, ids=[f"{k}-{p}" for k, p in DAEMON_KILLS])
async def test_daemon_killed_at_a_phase(
    fleet: LocalFleet, reference_tokens, kind: str, phase: str
) -> None:  # type: ignore[no-untyped-def]
    warm = kind == "warm"
    worker, target = await source_for(fleet, warm)
    arm(fleet, f"after:{phase}=crash")

    async def crash(streams: Streams) -> None:
        await daemon_crashed(fleet, streams)

    op, tokens = await move_worker(fleet, worker, target, f"-{kind}-{phase}", crash)
    step = op.steps[0]
    assert step.kind == (pb.STEP_KIND_MIGRATE if warm else pb.STEP_KIND_COLD_START)
    if phase in FORWARD:
        assert_completed(op)
        assert step.sessions_carried >= 1, "the move carried no live session"
    else:
        assert_rolled_back(op, phase)
    assert tokens == reference_tokens[TOKENS]
    survivor = step.new_worker_id if phase in FORWARD else worker.worker_id
    assert await registry_matches_agents(fleet) == {survivor}


# -- the daemon dies while an agent call of a cold move is in flight -----------------------------
async def test_daemon_killed_while_the_target_agent_starts_a_cold_moves_worker(
    fleet: LocalFleet, reference_tokens, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The H200's agent holds inside StartWorker (the new worker already serves, nobody was told)
    when the daemon dies: the call is cancelled, the agent ends the worker it never reported,
    and the restarted daemon finds the step at ``target_reserved`` and rolls it back."""
    marker = tmp_path / "hold"
    worker, target = await source_for(fleet, warm=False)
    assert target == H200
    arm(fleet, f"agent:start:serving=hold:{marker}")

    async def kill_daemon_mid_call(streams: Streams) -> None:
        await released(marker)
        fleet.kill_daemon()
        assert_mid_stream(streams)
        await restart_daemon(fleet)
        marker.unlink()  # the agent's handler finishes into a closed call

    op, tokens = await move_worker(fleet, worker, target, "-cold-start-call", kill_daemon_mid_call)
    assert op.steps[0].kind == pb.STEP_KIND_COLD_START
    assert_rolled_back(op, "target_reserved")
    assert tokens == reference_tokens[TOKENS]
    assert await registry_matches_agents(fleet) == {worker.worker_id}


async def test_daemon_killed_while_the_source_agent_stops_a_cold_moves_source(
    fleet: LocalFleet, reference_tokens, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """After the switch the source's agent holds inside StopWorker (the process is gone, the
    daemon not yet told) when the daemon dies: the restarted daemon finds the step at
    ``switched`` and completes it, stopping the source again."""
    marker = tmp_path / "hold"
    worker, target = await source_for(fleet, warm=False)
    arm(fleet, f"agent:stop:stopped=hold:{marker}")

    async def kill_daemon_mid_call(streams: Streams) -> None:
        await released(marker)
        fleet.kill_daemon()
        await restart_daemon(fleet)
        marker.unlink()  # the agent's handler finishes into a closed call

    op, tokens = await move_worker(fleet, worker, target, "-cold-stop-call", kill_daemon_mid_call)
    assert op.steps[0].kind == pb.STEP_KIND_COLD_START
    assert_completed(op)
    assert op.steps[0].sessions_carried >= 1
    assert tokens == reference_tokens[TOKENS]
    assert await registry_matches_agents(fleet) == {op.steps[0].new_worker_id}


async def test_daemon_killed_while_an_agent_snapshots_for_a_warm_move(
    fleet: LocalFleet, reference_tokens, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The source's agent holds inside SnapshotWorker; the daemon dies meanwhile. The agent
    finishes into a closed call, and the restarted daemon rolls the step back."""
    marker = tmp_path / "hold"
    worker, target = await source_for(fleet, warm=True)
    arm(fleet, f"agent:snapshot:written=hold:{marker}")

    async def kill_daemon_mid_call(streams: Streams) -> None:
        await released(marker)
        fleet.kill_daemon()
        assert_mid_stream(streams)
        await restart_daemon(fleet)
        marker.unlink()

    op, tokens = await move_worker(fleet, worker, target, "-snapshot-call", kill_daemon_mid_call)
    assert_rolled_back(op, "target_reserved")
    assert tokens == reference_tokens[TOKENS]
    assert await registry_matches_agents(fleet) == {worker.worker_id}


# -- an agent dies --------------------------------------------------------------------------------
# (warm?, whose agent, the daemon's phase it dies after, the outcome)
AGENT_KILLS = [
    # the source's agent, before the snapshot: SnapshotWorker finds it down -> rolled back
    ("warm", "source", "target_reserved", False),
    # the destination's agent, before it fetches: FetchSnapshot finds it down -> rolled back
    ("warm", "target", "snapshot_taken", False),
    # the destination's agent once its worker serves: the rest talks to the workers and to
    # the source's agent, so the move completes without it
    ("warm", "target", "target_started", True),
]


@pytest.mark.parametrize(("kind", "whose", "phase", "completes"), AGENT_KILLS)
async def test_agent_killed_at_a_phase(
    fleet: LocalFleet,
    reference_tokens,
    tmp_path: Path,
    kind: str,
    whose: str,
    phase: str,
    completes: bool,
) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "hold"
    worker, target = await source_for(fleet, kind == "warm")
    node = worker.node_name if whose == "source" else target
    arm(fleet, f"after:{phase}=hold:{marker}")
    restarting: list[asyncio.Task[None]] = []

    async def kill_agent(streams: Streams) -> None:
        await released(marker)
        fleet.kill_agent(node)
        assert_mid_stream(streams)
        arm(fleet, "")
        marker.unlink()

        async def come_back() -> None:  # the agent restarts a little later, as systemd would
            await asyncio.sleep(2.0)
            await asyncio.to_thread(fleet.start_agent, SPEC[node], 120)

        restarting.append(asyncio.get_running_loop().create_task(come_back()))

    op, tokens = await move_worker(fleet, worker, target, f"-agent-{whose}-{phase}", kill_agent)
    await asyncio.gather(*restarting)
    if completes:
        assert_completed(op)
    else:
        assert_rolled_back(op)
    assert tokens == reference_tokens[TOKENS]
    await registered_anew(fleet, node)  # the restarted agent reports what it runs
    survivor = op.steps[0].new_worker_id if completes else worker.worker_id
    assert await registry_matches_agents(fleet) == {survivor}


# An agent that dies inside its handler, while the daemon's call to it is in flight: the call
# fails, the step rolls back, and the agent (restarted as systemd would) leaves only the
# source serving; a worker whose start it never answered is stopped when it re-adopts.
AGENT_CRASHES_IN_FLIGHT = [
    ("warm", "source", "agent:snapshot:written"),  # SnapshotWorker: the snapshot is stored
    ("warm", "target", "agent:fetch:received"),  # FetchSnapshot: the copy is verified, stored
    ("warm", "target", "agent:start:serving"),  # StartWorker: the restored worker serves
    ("cold", "target", "agent:start:serving"),  # StartWorker: the cold-started worker serves
]


@pytest.mark.parametrize(("kind", "whose", "failpoint"), AGENT_CRASHES_IN_FLIGHT)
async def test_agent_killed_while_its_call_is_in_flight(
    fleet: LocalFleet, reference_tokens, kind: str, whose: str, failpoint: str
) -> None:  # type: ignore[no-untyped-def]
    worker, target = await source_for(fleet, kind == "warm")
    node = worker.node_name if whose == "source" else target
    arm(fleet, f"{failpoint}=crash")
    dying = fleet.agent_procs[node]

    async def agent_comes_back(streams: Streams) -> None:
        await asyncio.to_thread(dying.wait, 180)  # it SIGKILLs itself inside the handler
        assert dying.returncode == -9, "the failpoint was not reached"
        assert_mid_stream(streams)
        arm(fleet, "")
        await asyncio.to_thread(fleet.start_agent, SPEC[node], 120)

    op, tokens = await move_worker(fleet, worker, target, f"-{kind}-{failpoint}", agent_comes_back)
    assert_rolled_back(op)
    assert tokens == reference_tokens[TOKENS]
    await registered_anew(fleet, node)  # the restarted agent reports what it runs
    assert await registry_matches_agents(fleet) == {worker.worker_id}


# -- the daemon dies at a phase of a retirement ---------------------------------------------------
GREEDY = SESSIONS[:2]


@pytest.mark.parametrize("phase", ["draining", "switched", "source_retired"])
async def test_daemon_killed_at_a_phase_of_a_retirement(
    fleet: LocalFleet, reference_tokens, phase: str
) -> None:  # type: ignore[no-untyped-def]
    """Two workers serve two sessions each; a rebalance retires one (no traffic: the plan wants
    fewer). Killed at ``draining`` the step rolls back and the worker takes sessions again;
    from ``switched`` on (it has drained) the retirement completes. No session is cut."""
    kept, _ = await source_for(fleet, warm=True)
    free = next(n for n in H100 if n != kept.node_name)
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        other = await start_worker(ops, free)
    arm(fleet, f"after:{phase}=crash")
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        streams = Streams()
        streams.follow(
            daemon, [(w.endpoint, s, f"-{w.worker_id}") for w in (kept, other) for s in GREEDY]
        )
        await asyncio.wait_for(streams.started.wait(), 120)
        op = await ops.Rebalance(
            pb.RebalanceRequest(reason=f"retire, crash at {phase}"), timeout=30
        )
        assert [s.kind for s in op.steps] == [pb.STEP_KIND_RETIRE]
        retiring = op.steps[0].worker_id
        assert fleet.daemon_proc is not None
        await asyncio.to_thread(fleet.daemon_proc.wait, 240)
        assert fleet.daemon_proc.returncode == -9, "the daemon's failpoint was not reached"
        if phase == "draining":  # later, the retiring worker's sessions have ended by design
            assert len(streams.open) == 2 * len(GREEDY), streams.counts
        await restart_daemon(fleet)
        final = await finished(ops, op.id)
        results = await streams.tokens()
    if phase == "draining":
        assert_rolled_back(final, phase)
    else:
        assert_completed(final)
    for sid, tokens in results.items():  # every session (two per worker) streamed to its end
        assert tokens == reference_tokens[TOKENS][sid.rsplit("-w-", 1)[0]], sid
    left = {kept.worker_id, other.worker_id} - ({retiring} if phase != "draining" else set())
    assert await registry_matches_agents(fleet) == left
