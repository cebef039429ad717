"""The one way an operation comes to exist, for an operator's request and the planner alike.

``submit`` is the use case "request -> checked steps -> recorded operation -> executor": an
idempotency key answers a retry before anything is re-planned (the same key with another
request, reason included, is refused), a request that leads to no step is refused as a failed
precondition, the move limits and model minimums hold for every caller, and the audit record
names who asked and why. The operator API (``api.operations``) and the automatic planner
(``app``) differ only in who they say they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetshift_common.blocking import in_thread
from fleetshift_common.errors import FleetShiftError
from fleetshift_daemon.core.execution import Executor
from fleetshift_daemon.core.moves import MovePlanner, MoveRequest, NothingToMove
from fleetshift_daemon.core.operations import Operation, OperationKind, OperationLog, Step
from fleetshift_daemon.core.placement import PlacementService
from fleetshift_daemon.core.plans import Plan
from fleetshift_daemon.core.registry import Registry

log = logging.getLogger("fleetshift.daemon.operations")

AUTOMATIC = "planner (automatic mode)"


class Submission:
    def __init__(
        self,
        ops: OperationLog,
        planner: MovePlanner,
        executor: Executor,
        placement: PlacementService,
        registry: Registry,
    ) -> None:
        self._ops = ops
        self._planner = planner
        self._executor = executor
        self._placement = placement
        self._registry = registry

    async def submit(
        self,
        kind: OperationKind,
        steps: Callable[[], Sequence[Step]],
        key: str,
        reason: str,
        who: str,
        request: Mapping[str, Any] | None = None,
        *,
        accepted: Callable[[], object] | None = None,
    ) -> Operation:
        """Record and start an operation; ``accepted`` runs (blocking) once every check passed,
        just before the operation is recorded (a drain cordons its node there)."""
        digest_of = {**(request or {}), "reason": reason}
        if key:  # a retry with a known key answers before re-planning
            existing = await in_thread(self._ops.find_by_key, key, digest_of)
            if existing is not None:
                return existing
        planned = tuple(await in_thread(steps))
        if not planned:
            raise NothingToMove("nothing to move: the request leads to no step", field="operation")
        self._planner.check_minimums(planned)
        self._planner.check_limits(planned, self._executor.running())
        if accepted is not None:
            await in_thread(accepted)
        op, created = await in_thread(
            self._ops.create, kind, who, reason, planned, idempotency_key=key, request=digest_of
        )
        if created:
            self._executor.submit(op)
        return op

    async def move(self, move: MoveRequest, key: str, reason: str, who: str) -> Operation:
        request = {
            "worker_id": move.worker_id,
            "target_node": move.target_node,
            "target_gpus": list(move.target_gpus),
            "target_role": move.target_role.value if move.target_role else "",
        }
        return await self.submit(
            OperationKind.MOVE_WORKER,
            lambda: (self._planner.move_step(move),),
            key,
            reason,
            who,
            request,
        )

    async def drain(self, node: str, key: str, reason: str, who: str) -> Operation:
        """Cordon the node, then move every worker off it (``kubectl drain``'s order: nothing
        new lands on the node while it empties). A refused drain cordons nothing."""
        return await self.submit(
            OperationKind.DRAIN,
            lambda: self._planner.drain_steps(node),
            key,
            reason or f"drain {node}",
            who,
            {"node_name": node},
            accepted=lambda: self._cordon_for_drain(node, reason),
        )

    def _cordon_for_drain(self, node: str, reason: str) -> None:
        if not self._registry.get(node).cordoned:
            self._registry.set_cordon(node, True, f"drain: {reason}" if reason else "drain")

    async def rebalance(self, key: str, reason: str, who: str) -> Operation:
        horizon = self._placement.settings.horizon_s
        return await self.submit(
            OperationKind.REBALANCE,
            lambda: self._planner.rebalance_steps(self._placement.dry_run(), horizon),
            key,
            reason or "rebalance to the best placement for the current mix",
            who,
            {"rebalance": True},
        )

    async def run_plan(self, plan: Plan) -> Operation | None:
        """Automatic mode: run a proposed plan, one at a time, under the operators' rules."""
        if self._executor.running():
            return None  # the last plan is still moving; the next pass re-plans from its result
        horizon = self._placement.settings.horizon_s
        reason = (
            f"efficiency {plan.efficiency_before:.3f} below target; "
            f"predicted gain {plan.gain_tokens_per_s:,.0f} tokens/s"
        )
        try:
            return await self.submit(
                OperationKind.REBALANCE,
                lambda: self._planner.rebalance_steps(plan, horizon),
                "",
                reason,
                AUTOMATIC,
            )
        except NothingToMove:
            return None
        except FleetShiftError as err:
            log.warning("automatic plan not executed: %s", err)
            return None
