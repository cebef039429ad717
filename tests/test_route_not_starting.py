"""Route never hands out a worker that is still starting.

Found by the main demo: while the planner started a new prefill worker, Route chose it (it
counted as healthy) and the gateway got an empty endpoint, so requests failed with HTTP 500
until it served. A starting worker is now out of the router's index until it has an
endpoint, and routed to only as a last resort before it is serving."""

from __future__ import annotations

from pathlib import Path

from fleetshift_common.vocabulary import Role, WorkerState
from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.perfmodel import Dtype
from fleetshift_daemon.core.placement import PlacementService
from fleetshift_daemon.core.routing import RouteRequest
from fleetshift_daemon.core.workers import WorkerRecord, WorkerSpec
from fleetshift_daemon.store.work_store import SqlEfficiencyStore

from .test_phase_machine import MODEL, World


def test_a_starting_worker_is_never_routed_to(tmp_path: Path) -> None:
    world = World(tmp_path)
    daemon = world.boot()
    world.populate(daemon)
    placement = PlacementService(
        daemon.registry, daemon.workers, default_catalogue(), world.models, world.clock,
        SqlEfficiencyStore(world.engine),
    )  # fmt: skip
    starting = WorkerRecord(
        "starting", "h100-b", WorkerSpec(MODEL, Role.PREFILL, 4, Dtype.BF16), (4, 5, 6, 7), "",
        WorkerState.STARTING, world.clock(),
    )  # fmt: skip
    daemon.workers.add(starting)
    placement.refresh_fleet()
    chosen = set()
    for prompt in (100, 1000, 3000):  # prompt-heavy requests: a prefill worker would fit best
        routed = placement.route(RouteRequest(MODEL, prompt, expected_output_tokens=8))
        chosen.add(routed.worker.id)
        if routed.decode_worker is not None:
            chosen.add(routed.decode_worker.id)
        assert routed.worker.endpoint
    assert "starting" not in chosen and chosen <= {"src", "other"}
    world.engine.dispose()
