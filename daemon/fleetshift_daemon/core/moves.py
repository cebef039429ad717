"""Turning an operator's request or a planner's plan into checked, executable steps.

Everything that can be refused is refused here, before an operation exists: a cordoned or lost
target, GPUs that are busy, absent or too small for the model, a move that would leave a model
below its minimum of serving workers, or more moves in flight than the limits allow. So a
refused request starts nothing and leaves no trace but the error.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleetshift_common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from fleetshift_daemon.core.engine_fit import EngineCannotRun, check_tp
from fleetshift_daemon.core.fleet import NodeRecord, NodeState
from fleetshift_daemon.core.operations import Operation, Step, StepKind
from fleetshift_daemon.core.perfmodel import Deployment
from fleetshift_daemon.core.placement import PlacementService, WorkerSlot
from fleetshift_daemon.core.planner import PlacedWorker
from fleetshift_daemon.core.plans import MoveKind, Plan
from fleetshift_daemon.core.registry import Registry
from fleetshift_daemon.core.routing import Role
from fleetshift_daemon.core.workers import WorkerSpec, WorkerState, WorkerTable


class NothingToMove(FailedPrecondition):
    """A valid request that leads to no step (an empty node, a fleet already in place)."""


class PlanDoesNotPayOff(FailedPrecondition):
    """A rebalance whose moves would cost more goodput than they gain over the horizon."""


@dataclass(frozen=True)
class MoveLimits:
    max_in_flight: int = 2  # steps running at once, fleet-wide
    max_per_node: int = 1  # per source or target node
    max_per_model: int = 1


@dataclass(frozen=True)
class MoveRequest:
    worker_id: str
    target_node: str
    target_gpus: tuple[int, ...] = ()
    target_role: Role | None = None


class MovePlanner:
    """Builds steps; reads the registry, never writes it."""

    def __init__(
        self,
        registry: Registry,
        workers: WorkerTable,
        placement: PlacementService,
        limits: MoveLimits | None = None,
        retire_surplus: bool = False,
    ) -> None:
        self._registry = registry
        self._workers = workers
        self._placement = placement
        self.limits = limits or MoveLimits()
        self.retire_surplus = retire_surplus

    def move_step(
        self, req: MoveRequest, index: int = 0, reserved: Iterable[tuple[str, int]] = ()
    ) -> Step:
        worker = self._workers.get(req.worker_id)
        if not worker.state.alive or worker.operation_id:
            raise FailedPrecondition(
                f"worker {worker.id!r} is {worker.state.value}"
                + (f" and owned by operation {worker.operation_id}" if worker.operation_id else ""),
                field="worker_id",
            )
        target = self._target_node(req.target_node)
        role = req.target_role or worker.spec.role
        if target.name == worker.node and (
            not req.target_gpus or set(req.target_gpus) == set(worker.gpu_indices)
        ):
            if role is worker.spec.role:
                raise InvalidArgument(
                    "the move changes nothing: same node, GPUs and role", field="target_node"
                )
            return Step(
                index, StepKind.ROLE_CHANGE, worker.id, target.name, role, worker.gpu_indices
            )
        gpus = self._target_gpus(worker.spec, target, req.target_gpus, set(reserved))
        source_kind = self._kind(self._registry.get(worker.node))
        target_kind = self._kind(target)
        served = self._placement.models.get(worker.spec.model)
        warm = source_kind == target_kind and (served is None or served.snapshots)
        kind = StepKind.MIGRATE if warm else StepKind.COLD_START
        return Step(index, kind, worker.id, target.name, role, gpus)

    def _target_node(self, name: str) -> NodeRecord:
        if not name:
            raise InvalidArgument("target_node must name a node", field="target_node")
        node = self._registry.get(name)
        if node.state is not NodeState.READY:
            raise FailedPrecondition(
                f"target node {name!r} is {node.state.value}", field="target_node"
            )
        if node.cordoned:
            raise FailedPrecondition(
                f"target node {name!r} is cordoned ({node.cordon_reason or 'no reason given'})",
                field="target_node",
            )
        return node

    def _kind(self, node: NodeRecord) -> str:
        kind = self._placement.gpu_kind(node)
        return kind.name if kind else node.gpu_products[0] if node.gpus else ""

    def slot(self, spec: WorkerSpec, node_name: str, wanted: Sequence[int] = ()) -> tuple[int, ...]:
        """GPUs for a new worker on a named node (checked like a move's target)."""
        return self._target_gpus(spec, self._target_node(node_name), wanted, set())

    def _target_gpus(
        self,
        spec: WorkerSpec,
        target: NodeRecord,
        wanted: Sequence[int],
        reserved: set[tuple[str, int]],
    ) -> tuple[int, ...]:
        tp = spec.tp
        served = self._placement.models.get(spec.model)
        if served is not None:  # the engine's one-device limit, before any agent call
            check_tp(spec.model, served.engine, tp, target)
        present = {g.index for g in target.gpus}
        busy = self._workers.gpus_in_use(target.name) | {i for n, i in reserved if n == target.name}
        if wanted:
            if len(wanted) != tp or len(set(wanted)) != tp:
                raise InvalidArgument(
                    f"target_gpus must list {tp} distinct GPUs (the worker's tensor parallelism)",
                    field="target_gpus",
                )
            absent = sorted(set(wanted) - present)
            if absent:
                raise FailedPrecondition(
                    f"target node {target.name!r} has no GPU {absent}", field="target_gpus"
                )
            taken = sorted(set(wanted) & busy)
            if taken:
                raise FailedPrecondition(
                    f"GPUs {taken} of {target.name!r} are held by another worker",
                    field="target_gpus",
                )
            gpus = tuple(sorted(wanted))
        else:
            free = sorted(present - busy)
            if len(free) < tp:
                raise FailedPrecondition(
                    f"target node {target.name!r} has {len(free)} free GPUs, the worker needs {tp}",
                    field="target_gpus",
                )
            gpus = tuple(free[:tp])
        self._check_memory(spec, target)
        return gpus

    def _check_memory(self, spec: WorkerSpec, target: NodeRecord) -> None:
        served = self._placement.models.get(spec.model)
        kind = self._placement.gpu_kind(target)
        if served is None or kind is None:
            return  # unknown to the performance model: the agent's own start will tell
        dep = Deployment(served.arch, kind, spec.tp, spec.dtype)
        try:
            fits = self._placement.perf.kv_capacity_tokens(dep, 0.0) > 0
        except FailedPrecondition:
            fits = False
        if not fits:
            raise FailedPrecondition(
                f"{spec.model!r} at tp {spec.tp} does not fit in the memory of "
                f"{target.name!r} ({kind.name})",
                field="target_node",
            )

    def drain_steps(self, node_name: str) -> tuple[Step, ...]:
        """A move for each live worker of the node, each to the best free slot elsewhere,
        preferring a node of the same GPU model (a warm move keeps the sessions' KV) and
        taking another model (a cold move) only where no such node has room."""
        node = self._registry.get(node_name)
        steps: list[Step] = []
        reserved: list[tuple[str, int]] = []
        for worker in self._workers.all(node=node.name):
            if not worker.state.alive:
                continue
            target = self._drain_target(node, worker.spec, reserved)
            step = self.move_step(
                MoveRequest(worker.id, target.node, target.gpu_indices), len(steps), reserved
            )
            reserved.extend((target.node, i) for i in step.target_gpus)
            steps.append(step)
        return tuple(steps)

    def _drain_target(
        self, node: NodeRecord, spec: WorkerSpec, reserved: Sequence[tuple[str, int]]
    ) -> WorkerSlot:
        kind = self._kind(node)
        other_kinds = {n.name for n in self._registry.nodes() if self._kind(n) != kind}

        def best(excluded: set[str]) -> WorkerSlot:
            return self._placement.place_worker(
                spec.model,
                spec.role,
                spec.tp,
                spec.dtype,
                exclude_nodes=excluded,
                reserved=reserved,
            )

        try:
            return best({node.name} | other_kinds)  # a warm move, where one is possible
        except FailedPrecondition:
            return best({node.name})

    def rebalance_steps(self, plan: Plan, horizon_s: float) -> tuple[Step, ...]:
        """The steps of a plan worth executing: all of them when its gain over ``horizon_s``
        beats the cost of its moves (PlanRebalance's ``pays_off``), else only the
        retirements of surplus workers (they give GPUs back and move no session)."""
        steps = self.plan_steps(plan)
        if plan.pays_off(horizon_s):
            return steps
        retiring = [s for s in steps if s.kind is StepKind.RETIRE]
        if steps and not retiring:
            raise PlanDoesNotPayOff(
                f"the plan does not pay off: a gain of {plan.gain_tokens_per_s:,.0f} tokens/s "
                f"over the {horizon_s:.0f} s horizon does not beat its moves' cost of "
                f"{plan.total_cost_tokens:,.0f} tokens; nothing was started",
                field="operation",
            )
        return tuple(dataclasses.replace(s, index=i) for i, s in enumerate(retiring))

    def plan_steps(self, plan: Plan) -> tuple[Step, ...]:
        """The executable part of a plan: role changes, moves, new workers and, with
        ``retire_surplus``, retirements of the workers it no longer wants (otherwise they keep
        serving until an operator drains them)."""
        steps: list[Step] = []
        reserved: list[tuple[str, int]] = []
        retiring = self._retire_steps(plan) if self.retire_surplus else []
        for move in plan.moves:
            if move.kind is MoveKind.START and move.target is not None:
                start = self._start_step(move.target, len(steps), reserved)
                if start is not None:
                    reserved.extend((start.target_node, i) for i in start.target_gpus)
                    steps.append(start)
                continue
            if move.kind not in (MoveKind.ROLE_CHANGE, MoveKind.MIGRATE, MoveKind.COLD_START):
                continue
            if move.source is None or move.target is None or not move.source.worker_id:
                continue
            try:
                step = self.move_step(
                    MoveRequest(move.source.worker_id, move.target.node, (), move.target.role),
                    len(steps),
                    reserved,
                )
            except EngineCannotRun:
                raise
            except (FailedPrecondition, InvalidArgument, NotFound):
                continue  # the fleet moved on since the plan; the next pass re-plans
            reserved.extend((step.target_node, i) for i in step.target_gpus)
            steps.append(step)
        # Make-before-break at the plan's scale too: new capacity first, then moves, then
        # role changes (which take capacity from one phase to give it to the other).
        # Retirements last: a surplus worker goes only once everything else stands.
        order = {StepKind.START: 0, StepKind.MIGRATE: 1, StepKind.COLD_START: 1}
        ordered = sorted(steps, key=lambda s: order.get(s.kind, 2)) + retiring
        return tuple(dataclasses.replace(s, index=i) for i, s in enumerate(ordered))

    def _retire_steps(self, plan: Plan) -> list[Step]:
        """STOP moves as retirements, never taking a model below one serving worker (or its
        minimum): a model at zero workers could not be routed to, so its demand would never
        be seen again to bring it back."""
        serving = Counter(
            w.spec.model
            for w in self._workers.alive()
            if w.state is WorkerState.SERVING and not w.operation_id
        )
        out: list[Step] = []
        for move in plan.moves:
            if move.kind is not MoveKind.STOP or move.source is None:
                continue
            worker = self._workers.find(move.source.worker_id or "")
            if worker is None or worker.state is not WorkerState.SERVING or worker.operation_id:
                continue
            floor = max(1, self._min_workers(worker.spec.model))
            if serving[worker.spec.model] - 1 < floor:
                continue
            serving[worker.spec.model] -= 1
            out.append(Step(0, StepKind.RETIRE, worker.id, worker.node, worker.spec.role))
        return out

    def _min_workers(self, model: str) -> int:
        served = self._placement.models.get(model)
        return served.min_workers if served else 0

    def _start_step(
        self, target: PlacedWorker, index: int, reserved: Sequence[tuple[str, int]]
    ) -> Step | None:
        spec = WorkerSpec(target.model, target.role, target.tp, target.dtype)
        try:
            gpus = self._target_gpus(spec, self._target_node(target.node), (), set(reserved))
        except EngineCannotRun:
            raise
        except (FailedPrecondition, InvalidArgument, NotFound):
            return None  # the node changed since the plan; the next pass re-plans
        return Step(
            index,
            StepKind.START,
            "",
            target.node,
            target.role,
            gpus,
            model=target.model,
            tp=target.tp,
            dtype=target.dtype,
        )

    def check_minimums(self, steps: Sequence[Step]) -> None:
        """A model must keep its minimum of serving workers at every moment of the operation.

        Moves are make-before-break, so a move never lowers the count; what can is a worker
        already failed or draining elsewhere. Refuse when the model is below its minimum now
        and the operation would take a serving worker into a move."""
        serving = Counter(
            w.spec.model for w in self._workers.alive() if w.state is WorkerState.SERVING
        )
        for step in steps:
            if step.kind is StepKind.START:
                continue  # adds a worker, never removes one
            worker = self._workers.get(step.worker_id)
            minimum = self._min_workers(worker.spec.model)
            if serving[worker.spec.model] - 1 < minimum and step.kind is not StepKind.ROLE_CHANGE:
                raise FailedPrecondition(
                    f"moving {worker.id!r} would leave {worker.spec.model!r} with "
                    f"{serving[worker.spec.model] - 1} serving workers during the move, below its "
                    f"minimum of {minimum}",
                    field="worker_id",
                )

    def check_limits(self, steps: Sequence[Step], running: Iterable[Operation]) -> None:
        in_flight = [s for op in running for s in op.steps if not s.state.finished]
        if len(in_flight) + min(len(steps), 1) > self.limits.max_in_flight:
            raise ResourceExhausted(
                f"{len(in_flight)} moves are in flight, the limit is {self.limits.max_in_flight}; "
                "retry when one finishes",
                field="operation",
            )
