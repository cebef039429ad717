"""Node state writes stay off the heartbeat path (the load bench, issue 17).

A heartbeat runs on the daemon's event loop and takes the registry lock. A lost node heard
again used to write its state there, and the liveness sweep wrote each node it turned lost
while holding that lock: when many nodes turned at once (a registration outlasting the lost
timeout, a stall), every heartbeat and Route waited for a database round trip per node, more
nodes fell silent, and the single-daemon load bench on PostgreSQL lost all 1,000 nodes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fleetshift_daemon.core.fleet import GpuInfo, InventorySource, NodeState, Registration
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.store.database import make_engine, upgrade
from fleetshift_daemon.store.registry_store import SqlRegistryStore


class GatedStore(SqlRegistryStore):
    """A real SQLite registry store whose status writes wait until the test opens a gate."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.gated = False

    def update_status(self, name: str, state: NodeState, cordoned: bool, reason: str) -> None:
        if self.gated:
            self.writing.set()
            assert self.gate.wait(10)
        super().update_status(name, state, cordoned, reason)


def fleet(tmp_path: Path, clock: list[float]) -> tuple[GatedStore, Registry]:
    engine = make_engine(f"sqlite:///{tmp_path / 'db'}")
    upgrade(engine)
    store = GatedStore(engine)
    registry = Registry(store, lambda: clock[0], lost_after_s=5)
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 << 30)
    for name in ("n1", "n2"):
        registry.register(
            Registration(name, "10.0.0.9:1", (gpu,), inventory_source=InventorySource.DECLARED)
        )
    return store, registry


def stored(store: SqlRegistryStore) -> dict[str, NodeState]:
    return {n.name: n.state for n in store.load_nodes()}


def test_heartbeats_are_answered_while_the_sweep_writes_lost_nodes(tmp_path: Path) -> None:
    clock = [100.0]
    store, registry = fleet(tmp_path, clock)
    clock[0] = 106.0  # both silent past the timeout
    store.gated = True
    sweep = threading.Thread(target=registry.sweep)
    sweep.start()
    assert store.writing.wait(10)  # the sweep is inside a status write
    answered = threading.Event()
    beat = threading.Thread(target=lambda: (registry.heartbeat("n2"), answered.set()))
    beat.start()
    assert answered.wait(5), "a heartbeat waited for the sweep's database write"
    store.gate.set()
    sweep.join(10)
    beat.join(10)
    assert registry.get("n1").state is NodeState.LOST
    assert registry.get("n2").state is NodeState.READY  # heard again after it turned
    assert stored(store)["n1"] is NodeState.LOST


def test_a_lost_node_heard_again_is_stored_ready_by_the_next_sweep(tmp_path: Path) -> None:
    clock = [100.0]
    store, registry = fleet(tmp_path, clock)
    clock[0] = 106.0
    assert sorted(registry.sweep()) == ["n1", "n2"]
    assert stored(store) == {"n1": NodeState.LOST, "n2": NodeState.LOST}
    store.gated = True  # a write on the heartbeat's path would now block it
    assert registry.heartbeat("n1").state is NodeState.READY
    assert stored(store)["n1"] is NodeState.LOST  # not written on the heartbeat's path
    store.gated = False
    registry.set_cordon("n2", True, "disk")
    assert registry.sweep() == []
    assert stored(store) == {"n1": NodeState.READY, "n2": NodeState.LOST}
    assert store.load_nodes()[1].cordoned  # the cordon written meanwhile stays
