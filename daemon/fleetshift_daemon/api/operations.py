"""Servicer of the Operations service: rebalance, drain, move, and the audit history.

Each action is one call of the operations use case (``core.submission``): it validates the
request into steps before an operation is recorded, so a refused request starts nothing;
accepted ones are handed to the executor and answered at once with the PENDING operation
(progress: GetOperation or the WatchOperation stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift_common.errors import InvalidArgument, NotFound
from fleetshift_daemon.api import convert
from fleetshift_daemon.core.execution import Executor
from fleetshift_daemon.core.moves import MovePlanner, MoveRequest
from fleetshift_daemon.core.operations import (
    Operation,
    OperationKind,
    OperationLog,
    OperationState,
    Step,
    StepKind,
    StepState,
)
from fleetshift_daemon.core.placement import PlacementService
from fleetshift_daemon.core.submission import Submission
from fleetshift_daemon.core.workers import WorkerSpec, WorkerTable, check_worker_id
from fleetshift_daemon.wire import role_pb
from fleetshift_rpc.errors import rpc_errors, status_for
from fleetshift_rpc.security import current_principal
from fleetshift_rpc.server import ServiceBinding

KIND_TO_PB = {
    OperationKind.REBALANCE: pb.OPERATION_KIND_REBALANCE,
    OperationKind.DRAIN: pb.OPERATION_KIND_DRAIN,
    OperationKind.MOVE_WORKER: pb.OPERATION_KIND_MOVE_WORKER,
}
STATE_TO_PB = {
    OperationState.PENDING: pb.OPERATION_STATE_PENDING,
    OperationState.RUNNING: pb.OPERATION_STATE_RUNNING,
    OperationState.SUCCEEDED: pb.OPERATION_STATE_SUCCEEDED,
    OperationState.FAILED: pb.OPERATION_STATE_FAILED,
    OperationState.CANCELLED: pb.OPERATION_STATE_CANCELLED,
}
STEP_KIND_TO_PB = {
    StepKind.ROLE_CHANGE: pb.STEP_KIND_ROLE_CHANGE,
    StepKind.MIGRATE: pb.STEP_KIND_MIGRATE,
    StepKind.COLD_START: pb.STEP_KIND_COLD_START,
    StepKind.START: pb.STEP_KIND_START,
    StepKind.RETIRE: pb.STEP_KIND_RETIRE,
}
STEP_STATE_TO_PB = {
    StepState.PENDING: pb.STEP_STATE_PENDING,
    StepState.RUNNING: pb.STEP_STATE_RUNNING,
    StepState.DONE: pb.STEP_STATE_DONE,
    StepState.ROLLED_BACK: pb.STEP_STATE_ROLLED_BACK,
    StepState.SKIPPED: pb.STEP_STATE_SKIPPED,
}


def step_pb(step: Step) -> pb.OperationStep:
    return pb.OperationStep(
        index=step.index,
        kind=STEP_KIND_TO_PB[step.kind],
        worker_id=step.worker_id,
        target_node=step.target_node,
        target_role=role_pb(step.target_role),
        target_gpus=list(step.target_gpus),
        phase=step.phase.value,
        state=STEP_STATE_TO_PB[step.state],
        new_worker_id=step.new_worker_id,
        snapshot_id=step.snapshot_id,
        bytes_moved=step.bytes_moved,
        sessions_carried=step.sessions_carried,
        sessions_kv_restored=step.sessions_kv_restored,
        max_session_pause_ms=step.max_session_pause_ms,
        started_at=convert.timestamp(step.started_at),
        finished_at=convert.timestamp(step.finished_at),
        error=step.error,
    )


def operation_pb(op: Operation) -> pb.Operation:
    return pb.Operation(
        id=op.id,
        kind=KIND_TO_PB[op.kind],
        state=STATE_TO_PB[op.state],
        requested_by=op.requested_by,
        reason=op.reason,
        idempotency_key=op.idempotency_key,
        steps=[step_pb(s) for s in op.steps],
        created_at=convert.timestamp(op.created_at),
        updated_at=convert.timestamp(op.updated_at),
        error=op.error,
        cancel_requested=op.cancel_requested,
        bytes_moved=op.bytes_moved,
        sessions_carried=op.sessions_carried,
    )


def _who() -> str:
    principal = current_principal()
    return principal.label if principal else "unknown"


class OperationsServicer(pb_grpc.OperationsServicer):
    def __init__(
        self,
        ops: OperationLog,
        planner: MovePlanner,
        executor: Executor,
        placement: PlacementService,
        workers: WorkerTable,
        submission: Submission,
    ) -> None:
        self._ops = ops
        self._planner = planner
        self._executor = executor
        self._placement = placement
        self._workers = workers
        self._submission = submission
        self._watchers: set[asyncio.Queue[Operation]] = set()
        loop = asyncio.get_running_loop()

        def changed(op: Operation) -> None:  # called from the executor's store threads
            loop.call_soon_threadsafe(self._notify, op)

        ops.on_change(changed)

    def _notify(self, op: Operation) -> None:
        for queue in self._watchers:
            queue.put_nowait(op)

    @rpc_errors
    async def StartWorker(
        self, request: pb.StartFleetWorkerRequest, context: grpc.aio.ServicerContext
    ) -> fpb.WorkerStatus:
        role = convert.role(request.role)
        dtype = convert.dtype(request.dtype)
        if request.node_name:
            tp = request.tensor_parallel or 1
            spec = WorkerSpec(request.model, role, tp, dtype)
            if request.model not in self._placement.models:
                raise NotFound(
                    f"model {request.model!r} is not served by this fleet", field="model"
                )
            gpus = await asyncio.to_thread(
                self._planner.slot, spec, request.node_name, tuple(request.gpu_indices)
            )
            node = request.node_name
        else:
            slot = await asyncio.to_thread(
                self._placement.place_worker, request.model, role, request.tensor_parallel, dtype
            )
            node, gpus = slot.node, slot.gpu_indices
            spec = WorkerSpec(request.model, role, len(gpus), dtype)
        worker = await self._executor.start_worker(spec, node, gpus)
        return convert.with_engine(convert.worker_pb(worker), self._placement)

    @rpc_errors
    async def StopWorker(
        self, request: pb.StopFleetWorkerRequest, context: grpc.aio.ServicerContext
    ) -> fpb.WorkerStatus:
        check_worker_id(request.worker_id)
        return convert.worker_pb(await self._executor.stop_worker(request.worker_id))

    @rpc_errors
    async def MoveWorker(
        self, request: pb.MoveWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.Operation:
        check_worker_id(request.worker_id)
        role = None
        if request.target_role != fpb.WORKER_ROLE_UNSPECIFIED:
            role = convert.role(request.target_role, "target_role")
        move = MoveRequest(request.worker_id, request.target_node, tuple(request.target_gpus), role)
        op = await self._submission.move(move, request.idempotency_key, request.reason, _who())
        return operation_pb(op)

    @rpc_errors
    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.Operation:
        if not request.node_name:
            raise InvalidArgument("node_name must name a node", field="node_name")
        op = await self._submission.drain(
            request.node_name, request.idempotency_key, request.reason, _who()
        )
        return operation_pb(op)

    @rpc_errors
    async def Rebalance(
        self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.Operation:
        op = await self._submission.rebalance(request.idempotency_key, request.reason, _who())
        return operation_pb(op)

    @rpc_errors
    async def GetOperation(
        self, request: pb.GetOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.Operation:
        return operation_pb(self._ops.get(request.operation_id))

    @rpc_errors
    async def ListOperations(
        self, request: pb.ListOperationsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListOperationsResponse:
        ops = self._ops.list(min(request.limit or 50, 1000), request.unfinished_only)
        return pb.ListOperationsResponse(operations=[operation_pb(o) for o in ops])

    async def WatchOperation(
        self, request: pb.WatchOperationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Operation]:
        try:
            op = self._ops.get(request.operation_id)
        except (InvalidArgument, NotFound) as err:
            await context.abort(status_for(err), err.message)
            return
        queue: asyncio.Queue[Operation] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            yield operation_pb(op)
            while not op.state.finished:
                update = await queue.get()
                if update.id == op.id:
                    op = update
                    yield operation_pb(op)
        finally:
            self._watchers.discard(queue)

    @rpc_errors
    async def CancelOperation(
        self, request: pb.CancelOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.Operation:
        op = await asyncio.to_thread(self._ops.request_cancel, request.operation_id)
        return operation_pb(op)

    @rpc_errors
    async def LocateSession(
        self, request: pb.LocateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionLocation:
        if not request.session_id:
            raise InvalidArgument("session_id must not be empty", field="session_id")
        worker = self._workers.locate_session(request.session_id)
        if worker is None:
            raise NotFound(
                f"session {request.session_id!r} is not on any known worker", field="session_id"
            )
        return pb.SessionLocation(
            session_id=request.session_id,
            worker_id=worker.id,
            endpoint=worker.endpoint,
            node_name=worker.node,
        )


def bindings(servicer: OperationsServicer) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            pb_grpc.add_OperationsServicer_to_server,
            servicer,
            pb.DESCRIPTOR.services_by_name["Operations"].full_name,
        )
    ]
