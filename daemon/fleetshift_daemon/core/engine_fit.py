"""Whether a model's engine really runs a worker at a tensor-parallel size, on a given node.

The planner and the performance model reason about TP 1/2/4/8, but the engine that serves a
model decides which of those are real (``fleetshift_common.engines``): the reference engine
computes on one device. The daemon applies that at its boundary, before any agent call:

- on a node whose GPUs are real (NVML inventory) a size the engine does not run is **refused**
  (FAILED_PRECONDITION naming the model and the engine): the worker would hold GPUs it never
  uses, and load the whole model onto the first;
- on a declared inventory (a CPU test fleet) it is accepted as **nominal**: its GPUs are
  reserved and every worker computes on the CPU anyway, so tests and demos still exercise the
  planner's TP choices; the plan and ``fleetshift workers`` say so;
- the planner is only offered the sizes it could start: on a fleet with any real-GPU node, the
  engine's real sizes among the model's ``tp_options``.

The agent keeps its own check (defence in depth for a daemon of another version).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from fleetshift_common.engines import engine_traits, runs_tp
from fleetshift_common.errors import FailedPrecondition
from fleetshift_daemon.core.fleet import InventorySource, NodeRecord


class TpFit(enum.Enum):
    REAL = "real"  # the engine computes on that many devices
    NOMINAL = "nominal"  # declared inventory: GPUs reserved, the worker computes on one device
    REFUSED = "refused"  # real GPUs the worker would hold and never use


def tp_fit(engine: str, tp: int, node: NodeRecord) -> TpFit:
    if runs_tp(engine, tp):
        return TpFit.REAL
    if node.inventory_source is InventorySource.DECLARED:
        return TpFit.NOMINAL
    return TpFit.REFUSED


class EngineCannotRun(FailedPrecondition):
    """A worker shape the model's engine does not run on real GPUs. A plan step refused for
    this is not "the fleet moved on since the plan": the whole plan is refused by name."""


def refusal(model: str, engine: str, tp: int, node: str) -> EngineCannotRun:
    traits = engine_traits(engine)
    sizes = ", ".join(map(str, traits.real_tp))
    return EngineCannotRun(
        f"model {model!r} is served by the {engine!r} engine, which computes on "
        f"{traits.computes_on}: tensor_parallel {tp} on node {node!r} (real GPUs) would hold "
        f"{tp} GPUs and use one; the engine runs tensor_parallel {sizes}",
        field="tensor_parallel",
    )


def check_tp(model: str, engine: str, tp: int, node: NodeRecord) -> None:
    """Refuse (before any agent call) a worker shape the engine cannot run on real GPUs."""
    if tp_fit(engine, tp, node) is TpFit.REFUSED:
        raise refusal(model, engine, tp, node.name)


def planned_tp_options(
    engine: str, tp_options: tuple[int, ...], nodes: Iterable[NodeRecord]
) -> tuple[int, ...]:
    """The sizes the planner may choose from. With any real-GPU node in the fleet, only the
    engine's real ones (one set per model keeps the planner's options per GPU kind; a fleet
    mixing declared and real nodes loses its nominal sizes). When none of the configured
    sizes is real, they stay, and the daemon refuses each such start or move by name."""
    if not any(n.inventory_source is InventorySource.NVML for n in nodes):
        return tp_options
    real = tuple(t for t in tp_options if runs_tp(engine, t))
    return real or tp_options
