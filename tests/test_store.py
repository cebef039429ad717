"""The registry's SQL store, on SQLite and on PostgreSQL alike."""

from __future__ import annotations

import subprocess
import sys
import time

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from fleetshift_daemon.core.fleet import (
    GpuInfo,
    InventorySource,
    NodeState,
    NodeVersions,
    Registration,
)
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.store.database import (
    alembic_config,
    current_revision,
    make_engine,
    upgrade,
)
from fleetshift_daemon.store.models import Base
from fleetshift_daemon.store.registry_store import SqlRegistryStore

GiB = 1024**3
HEAD = ScriptDirectory.from_config(alembic_config()).get_current_head()


def h100_node(name: str, gpus: int = 2) -> Registration:
    return Registration(
        node_name=name,
        agent_address="10.0.0.7:50052",
        gpus=tuple(
            GpuInfo(
                i,
                "NVIDIA H100 80GB HBM3",
                80 * GiB,
                "hbm3",
                "9.0",
                True,
                (1 - i,) if gpus == 2 else (),
            )
            for i in range(gpus)
        ),
        versions=NodeVersions("550.54", "12.4", "2.13.0", "0.1.0"),
        inventory_source=InventorySource.DECLARED,
    )


def test_fresh_migration_matches_models_and_upgrade_twice_is_a_noop(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    first = current_revision(engine)
    upgrade(engine)
    assert current_revision(engine) == first == HEAD
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    assert {"nodes", "gpus", "workers", "operations", "alembic_version"} <= set(
        inspect(engine).get_table_names()
    )


def downgrade(engine: Engine, revision: str) -> None:
    with engine.connect() as conn:
        command.downgrade(alembic_config(conn), revision)
        conn.commit()


def test_every_migration_downgrades_and_upgrades_again(db_url: str) -> None:
    """Down to nothing and back up, one step at a time; the schema then still equals the
    models. Route arrivals an older replica published (0005, no publication number) survive
    0006, and several of them per replica and model still fit its unique index."""
    engine = make_engine(db_url)
    upgrade(engine, "0005_fs17")
    with engine.begin() as conn:
        for _ in range(2):
            conn.execute(
                text(
                    "INSERT INTO route_arrivals (replica, model, created_at, payload) "
                    "VALUES ('old', 'm', CURRENT_TIMESTAMP, '[[0.5, 10, 2.0]]')"
                )
            )
    upgrade(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM route_arrivals")).scalar() == 2
    revisions = [
        r.revision for r in ScriptDirectory.from_config(alembic_config()).walk_revisions()
    ]  # head first
    for below in [*revisions[1:], "base"]:
        downgrade(engine, below)
        assert current_revision(engine) == (None if below == "base" else below)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert current_revision(engine) == HEAD
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


def test_two_daemons_migrating_at_once_both_succeed(db_url: str) -> None:
    code = (
        "import sys; from fleetshift_daemon.store.database import make_engine, upgrade;"
        "upgrade(make_engine(sys.argv[1]))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, db_url]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    engine = make_engine(db_url)
    assert current_revision(engine) == HEAD
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1


def test_registry_survives_a_restart(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    now = [1000.0]
    registry = Registry(SqlRegistryStore(engine), lambda: now[0], lost_after_s=5)
    registry.load()
    registry.register(h100_node("node-a"))
    registry.register(h100_node("node-b", gpus=1))
    registry.set_cordon("node-b", True, "maintenance")
    now[0] += 1
    registry.heartbeat("node-a")
    registry.sweep()  # flushes the heartbeat time
    engine.dispose()

    reopened = Registry(SqlRegistryStore(make_engine(db_url)), lambda: now[0], lost_after_s=5)
    reopened.load()
    nodes = {n.name: n for n in reopened.nodes()}
    assert set(nodes) == {"node-a", "node-b"}
    assert nodes["node-a"].gpus == h100_node("node-a").gpus
    assert nodes["node-a"].last_heartbeat_at == 1001.0
    assert nodes["node-a"].inventory_source is InventorySource.DECLARED
    assert nodes["node-a"].versions.driver == "550.54"
    assert nodes["node-b"].cordoned and nodes["node-b"].cordon_reason == "maintenance"


def test_reregistration_replaces_the_inventory(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    registry = Registry(SqlRegistryStore(engine), time.time, lost_after_s=5)
    registry.load()
    _, created = registry.register(h100_node("node-a", gpus=2))
    assert created
    _, created = registry.register(h100_node("node-a", gpus=1))
    assert not created
    reloaded = SqlRegistryStore(engine).load_nodes()
    assert len(reloaded) == 1 and len(reloaded[0].gpus) == 1


def test_liveness_transitions_are_persisted(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    now = [0.0]
    registry = Registry(SqlRegistryStore(engine), lambda: now[0], lost_after_s=3)
    registry.load()
    registry.register(h100_node("node-a"))
    now[0] = 2.0
    assert registry.sweep() == []
    now[0] = 3.5
    assert registry.sweep() == ["node-a"]
    assert SqlRegistryStore(engine).load_nodes()[0].state is NodeState.LOST
    registry.heartbeat("node-a")
    assert registry.get("node-a").state is NodeState.READY
    assert registry.sweep() == []  # the sweep writes it, off the heartbeat's event loop
    assert SqlRegistryStore(engine).load_nodes()[0].state is NodeState.READY
