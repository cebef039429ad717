"""Silence the daemon caused is not the nodes' fault (issue 17's load bench lost up to all
1,000 healthy nodes to saturated daemons, and every Route then found no capacity).

- A fleet that falls silent at once: more than half of a fleet of ten or more silent past the
  timeout turns none of them lost; fewer, or a smaller fleet, turn lost as before.
- A daemon whose own event loop stalls: the stall is not counted as the nodes' silence
  (core/hearing.py); a node that stays silent afterwards still turns lost.

The registry's sweep on a real SQLite store with injected clocks, and the real daemon over
gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_common.config import ConfigError, DaemonConfig
from fleetshift_daemon.app import Daemon
from fleetshift_daemon.core.fleet import GpuInfo, InventorySource, NodeState, Registration
from fleetshift_daemon.core.hearing import HearingClock
from fleetshift_daemon.core.registry import Registry, SilenceGuard
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore

from .test_registry_api import registration

TIMEOUT_S = 5.0


def fleet(
    tmp_path: Path,
    clock: list[float],
    nodes: int,
    guard: SilenceGuard,
    hearing: HearingClock | None = None,
) -> Registry:
    engine = make_engine(f"sqlite:///{tmp_path / 'db'}")
    upgrade(engine)
    registry = Registry(
        SqlRegistryStore(engine),
        lambda: clock[0],
        TIMEOUT_S,
        silence_guard=guard,
        hearing=hearing,
    )
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 << 30)
    for i in range(nodes):
        registry.register(
            Registration(
                f"n{i:02d}", "10.0.0.9:1", (gpu,), inventory_source=InventorySource.DECLARED
            )
        )
    return registry


def states(registry: Registry) -> dict[str, NodeState]:
    return {n.name: n.state for n in registry.nodes()}


def test_a_fleet_silent_at_once_is_spared_until_the_rest_is_heard_again(tmp_path: Path) -> None:
    clock = [100.0]
    registry = fleet(tmp_path, clock, 12, SilenceGuard())
    clock[0] += TIMEOUT_S + 1  # the daemon heard nobody: a stall, or its network
    assert registry.sweep() == []
    assert set(states(registry).values()) == {NodeState.READY}
    assert registry.silent_unjudged == 12
    for i in range(11):  # heard again, all but one
        registry.heartbeat(f"n{i:02d}")
    assert registry.sweep() == ["n11"]  # one of twelve: that node's own trouble
    assert states(registry)["n11"] is NodeState.LOST
    assert registry.silent_unjudged == 0


@pytest.mark.parametrize(("nodes", "silent"), [(12, 6), (12, 1), (9, 9), (2, 2), (1, 1)])
def test_half_of_the_fleet_or_a_fleet_under_ten_turns_lost_as_before(
    tmp_path: Path, nodes: int, silent: int
) -> None:
    clock = [100.0]
    registry = fleet(tmp_path, clock, nodes, SilenceGuard())
    clock[0] += TIMEOUT_S + 1
    for i in range(silent, nodes):
        registry.heartbeat(f"n{i:02d}")
    assert sorted(registry.sweep()) == [f"n{i:02d}" for i in range(silent)]
    assert registry.silent_unjudged == 0


def test_fraction_one_turns_the_guard_off(tmp_path: Path) -> None:
    clock = [100.0]
    registry = fleet(tmp_path, clock, 12, SilenceGuard(fraction=1.0))
    clock[0] += TIMEOUT_S + 1
    assert len(registry.sweep()) == 12


@pytest.mark.parametrize(
    ("key", "value"),
    [("mass_silence_fraction", 0.0), ("mass_silence_fraction", 1.5), ("mass_silence_min_nodes", 0)],
)
def test_bad_guard_settings_are_refused_by_name(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key) as err:
        DaemonConfig(**{key: value})  # type: ignore[arg-type]
    assert err.value.field == key


async def test_the_daemon_spares_a_silent_fleet_says_so_and_judges_a_lone_silence(
    daemon: Daemon,
) -> None:
    """The suite's daemon: lost after 1 s of silence, swept every 0.1 s."""
    names = [f"node-{i:02d}" for i in range(10)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        agents, operator = pb_grpc.AgentRegistryStub(ch), pb_grpc.FleetOperatorStub(ch)
        for name in names:
            await agents.RegisterNode(registration(name))
        await asyncio.sleep(2.0)  # all ten silent past the 1 s timeout
        lost = await operator.ListNodes(pb.ListNodesRequest(state=pb.NODE_STATE_LOST))
        assert list(lost.nodes) == []
        assert unjudged(daemon) == 10

        async def beat_all_but_the_last() -> None:
            while True:
                for name in names[:-1]:
                    await agents.Heartbeat(pb.HeartbeatRequest(node_name=name))
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(beat_all_but_the_last())
        try:
            for _ in range(50):
                await asyncio.sleep(0.1)
                lost = await operator.ListNodes(pb.ListNodesRequest(state=pb.NODE_STATE_LOST))
                if lost.nodes:
                    break
            assert [n.name for n in lost.nodes] == [names[-1]]
            assert unjudged(daemon) == 0
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating


def test_a_stall_of_the_daemon_is_not_the_nodes_silence(tmp_path: Path) -> None:
    clock = [100.0]
    hearing = HearingClock(
        lambda: clock[0], tick_s=0.1, tolerance_s=0.05, monotonic=lambda: clock[0]
    )
    hearing.tick()
    registry = fleet(tmp_path, clock, 2, SilenceGuard(), hearing)  # heard at 100
    clock[0] = 106.0  # the daemon's loop stalled 6 s: no tick, no heartbeat read
    assert registry.sweep() == []  # on the wall clock both would be 6 s silent
    registry.heartbeat("n00")  # the stall ended: n00's heartbeats are read again, n01's not
    while clock[0] < 111.0:
        hearing.tick()
        clock[0] += 0.1
        registry.heartbeat("n00")
        turned = registry.sweep()
        if turned:
            break
    assert turned == ["n01"]  # silent 5 s of the time the daemon could hear
    assert clock[0] == pytest.approx(111.0, abs=0.11)  # the 6 s stall, less 0.15 s, later
    assert states(registry)["n00"] is NodeState.READY


async def test_the_daemon_does_not_declare_nodes_lost_for_its_own_stalled_loop(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Three agents heartbeat from their own thread; the daemon's event loop is blocked for
    twice the lost timeout while they pause (as agents whose heartbeats time out against a
    stalled daemon give up); two resume. No node is declared lost for the stall; the one
    that stays silent is, a timeout after the daemon could hear again."""
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=2.0,
        liveness_check_interval_s=0.1,
    )
    daemon = Daemon(config)
    await daemon.start()
    names = ["node-0", "node-1", "node-2"]
    beating = {name: threading.Event() for name in names}
    done = threading.Event()

    def agents() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            stub = pb_grpc.AgentRegistryStub(ch)
            for name in names:
                stub.RegisterNode(registration(name), timeout=10)
                beating[name].set()
            while not done.is_set():
                for name in names:
                    if beating[name].is_set():
                        stub.Heartbeat(pb.HeartbeatRequest(node_name=name), timeout=10)
                time.sleep(0.2)

    thread = threading.Thread(target=agents, daemon=True)
    thread.start()
    try:
        await asyncio.sleep(1.0)
        assert all(event.is_set() for event in beating.values())
        for event in beating.values():
            event.clear()
        time.sleep(4.0)  # blocks the loop on purpose: the daemon stalls, deaf, 4 s
        beating["node-0"].set()
        beating["node-1"].set()
        await asyncio.sleep(0.5)
        assert lost_total(daemon) == 0  # on the wall clock all three were 4 s silent
        for _ in range(40):
            await asyncio.sleep(0.1)
            if lost_total(daemon):
                break
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            lost = await pb_grpc.FleetOperatorStub(ch).ListNodes(
                pb.ListNodesRequest(state=pb.NODE_STATE_LOST)
            )
        assert [n.name for n in lost.nodes] == ["node-2"]
        assert lost_total(daemon) == 1
    finally:
        done.set()
        thread.join(10)
        await daemon.stop(grace_s=0.1)


def lost_total(daemon: Daemon) -> float | None:
    return daemon.metrics.registry.get_sample_value("fleetshift_nodes_lost_total")


def unjudged(daemon: Daemon) -> float | None:
    return daemon.metrics.registry.get_sample_value("fleetshift_nodes_silent_unjudged")
