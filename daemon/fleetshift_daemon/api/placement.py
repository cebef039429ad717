"""Servicers of the Placement (router, scheduler) and Planning (operators) services.

Thin by design: validate the shape of a message, convert it, call ``PlacementService``, convert
back. Route is the hot path: it runs on the event loop with no I/O (the router reads an
in-memory index), and its latency is recorded for the metrics endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from time import perf_counter

import grpc

from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.bounds import MAX_ROUTE_BATCH, check_items
from fleetshift_common.errors import FleetShiftError, InvalidArgument, NotFound
from fleetshift_daemon.api import convert
from fleetshift_daemon.api.calibration import basis_pb
from fleetshift_daemon.core.placement import EfficiencySample, PlacementService
from fleetshift_daemon.core.plans import MoveKind, Plan
from fleetshift_daemon.core.routing import RouteRequest, Slo
from fleetshift_daemon.core.workers import WorkerTable
from fleetshift_rpc.errors import rpc_errors, status_for
from fleetshift_rpc.metrics import DaemonMetrics
from fleetshift_rpc.route_stream import REPLICA_HEADER
from fleetshift_rpc.server import ServiceBinding
from fleetshift_rpc.validation import check_request

log = logging.getLogger("fleetshift.daemon.placement")
_REPLICA = f"{socket.gethostname()}:{os.getpid()}"  # this process, in RouteStream's headers

MOVE_KIND_TO_PB = {
    MoveKind.ROLE_CHANGE: pb.MOVE_KIND_ROLE_CHANGE,
    MoveKind.MIGRATE: pb.MOVE_KIND_MIGRATE,
    MoveKind.COLD_START: pb.MOVE_KIND_COLD_START,
    MoveKind.START: pb.MOVE_KIND_START,
    MoveKind.STOP: pb.MOVE_KIND_STOP,
}


def route_request(msg: pb.RouteRequest) -> RouteRequest:
    slo = None
    if msg.HasField("slo"):
        for name in ("ttft_ms", "tbt_ms"):
            value = getattr(msg.slo, name)
            if value < 0 or not math.isfinite(value):
                raise InvalidArgument(f"slo.{name} must be > 0 when set", field=f"slo.{name}")
        if msg.slo.ttft_ms == 0 and msg.slo.tbt_ms == 0:
            raise InvalidArgument(
                "slo is set but both slo.ttft_ms and slo.tbt_ms are 0", field="slo.ttft_ms"
            )
        slo = Slo(msg.slo.ttft_ms or None, msg.slo.tbt_ms or None)
    output = msg.expected_output_tokens if msg.HasField("expected_output_tokens") else None
    if output is not None and output <= 0:
        raise InvalidArgument(
            f"expected_output_tokens must be > 0, got {output}", field="expected_output_tokens"
        )
    return RouteRequest(
        model=msg.model,
        prompt_tokens=msg.prompt_tokens,
        expected_output_tokens=output,
        slo=slo,
        preferred_worker_id=msg.preferred_worker_id or None,
        reroute=msg.reroute,
    )


def efficiency_note(interval_s: float, has_samples: bool) -> str:
    """Why an efficiency report is empty, so a dashboard never shows a silent blank."""
    if interval_s <= 0:
        return (
            "the planner is off (planner.interval_s = 0): no efficiency figures are computed; "
            "PlanRebalance still answers a dry run"
        )
    if not has_samples:
        return f"no planning pass has run yet (one runs every {interval_s:g} s)"
    return ""


def sample_pb(sample: EfficiencySample) -> pb.EfficiencySample:
    return pb.EfficiencySample(
        taken_at=convert.timestamp(sample.taken_at),
        efficiency=sample.efficiency,
        current_goodput_tokens_per_s=sample.current_goodput,
        best_goodput_tokens_per_s=sample.best_goodput,
        plan_proposed=sample.plan_proposed,
    )


def plan_pb(plan: Plan, horizon_s: float, placement: PlacementService) -> pb.Plan:
    out = pb.Plan(
        efficiency_before=plan.efficiency_before,
        goodput_before_tokens_per_s=plan.goodput_before,
        goodput_after_tokens_per_s=plan.goodput_after,
        bytes_to_move=plan.bytes_to_move,
        pays_off=plan.pays_off(horizon_s),
        solver_status=plan.solver_status,
        solve_s=plan.solve_s,
    )
    for move in plan.moves:
        m = out.moves.add(
            kind=MOVE_KIND_TO_PB[move.kind],
            model=move.model,
            bytes_to_move=move.bytes_to_move,
            duration_s=move.duration_s,
            expected_pause_s=move.expected_pause_s,
            sessions_affected=move.sessions_affected,
            predicted_gain_tokens_per_s=move.predicted_gain_tokens_per_s,
            cost_tokens=move.cost_tokens,
            reason=move.reason,
        )
        for side, placed in (("source", move.source), ("target", move.target)):
            if placed is not None:
                planned = pb.PlannedWorker(
                    worker_id=placed.worker_id or "",
                    model=placed.model,
                    role=convert.ROLE_TO_PB[placed.role],
                    gpu_kind=placed.gpu_kind,
                    tensor_parallel=placed.tp,
                    dtype=placed.dtype.value,
                    node_name=placed.node,
                )
                getattr(m, side).CopyFrom(convert.with_engine(planned, placement))
    return out


def _refuse(answer: pb.RouteStreamAnswer, code: grpc.StatusCode, err: FleetShiftError) -> None:
    answer.error.code = code.value[0]
    answer.error.message = err.message
    answer.error.field = err.field or ""


async def no_catch_up() -> bool:
    return False


class PlacementServicer(pb_grpc.PlacementServicer):
    def __init__(
        self,
        service: PlacementService,
        metrics: DaemonMetrics | None,
        catch_up: Callable[[], Awaitable[bool]] = no_catch_up,
    ) -> None:
        self._service = service
        self._metrics = metrics
        self._catch_up = catch_up  # a follower re-reads the database (replicas.ReplicaLoop)

    @rpc_errors
    async def Route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext
    ) -> pb.RouteResponse:
        if self._metrics is None:
            return await self._route_or_catch_up(request)
        with self._metrics.time_route():
            return await self._route_or_catch_up(request)

    async def _route_or_catch_up(self, request: pb.RouteRequest) -> pb.RouteResponse:
        try:
            return self._route(request)
        except NotFound:
            # A follower's view may trail a write the leader has acknowledged: answer "no
            # worker" only after a re-read says so too (served models only: a caller naming
            # models nobody configured costs no database work).
            if request.model not in self._service.models or not await self._catch_up():
                raise
            return self._route(request)

    def _route(self, request: pb.RouteRequest) -> pb.RouteResponse:
        out = pb.RouteResponse()
        self._route_into(request, out)
        return out

    def _route_into(self, request: pb.RouteRequest, r: pb.RouteResponse) -> None:
        """Route ``request`` and write the answer into ``r``, field by field: on the stream
        ``r`` is the answer's own submessage, so no RouteResponse is built and copied."""
        routed = self._service.route(route_request(request))
        d = routed.decision
        t = d.terms
        worker, decode = routed.worker, routed.decode_worker
        r.worker_id = worker.id
        r.endpoint = worker.endpoint
        r.node_name = worker.node
        if decode is not None:
            r.decode_worker_id = decode.id
            r.decode_endpoint = decode.endpoint
        r.reason = d.reason
        terms = r.terms
        terms.phase_fit = t.phase_fit
        terms.latency = t.latency
        terms.load = t.load
        terms.kv_headroom = t.kv_headroom
        terms.health = t.health
        terms.affinity = t.affinity
        terms.total = t.total
        terms.predicted_ttft_ms = t.predicted_ttft_ms
        terms.predicted_tbt_ms = t.predicted_tbt_ms
        r.output_tokens = d.output_tokens
        r.output_estimated = d.output_estimated

    async def RouteStream(
        self,
        requests: AsyncIterator[pb.RouteStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.RouteStreamResponse]:
        """Route for each request of the stream, each answered as unary Route would answer
        it; a message's requests are answered together, in order, in one message. A refused
        request gets its error (the code Route would end with, the same message) and the stream
        goes on: one bad request from a router must not cut off the requests queued behind it.
        The stream saves gRPC's per-call work (a call's setup, headers, the interceptors'
        per-call checks) and, batched, its per-message work, which cost more than routing.

        The headers go out at once, before any answer: ``RouteClient`` writes nothing until it
        has them, so it can tell this from a daemon without RouteStream (UNIMPLEMENTED)."""
        await context.send_initial_metadata(((REPLICA_HEADER, _REPLICA),))
        async for msg in requests:
            out = pb.RouteStreamResponse()
            answers = out.answers
            try:
                check_items("requests", len(msg.requests), MAX_ROUTE_BATCH)
            except InvalidArgument as err:
                for item in msg.requests:
                    _refuse(answers.add(id=item.id), grpc.StatusCode.INVALID_ARGUMENT, err)
                yield out
                continue
            for item in msg.requests:
                answer = answers.add(id=item.id)
                if not self._answer_now(item, answer):
                    await self._stream_answer(item, answer)  # a follower's re-read first
            yield out

    def _answer_now(self, item: pb.RouteStreamItem, answer: pb.RouteStreamAnswer) -> bool:
        """Answer ``item`` without awaiting anything (the hot path: no coroutine per request).
        False, with nothing written or counted, when the model has no worker here yet and
        the answer needs the awaited re-read of ``_stream_answer`` (a follower's view)."""
        request = item.route
        try:
            check_request(request)
        except FleetShiftError as err:
            _refuse(answer, status_for(err), err)
            return True
        metrics = self._metrics
        start = perf_counter()
        try:
            self._route_into(request, answer.route)
        except NotFound as err:
            if request.model in self._service.models:
                answer.ClearField("route")
                return False
            self._count(metrics, start, ok=False)
            _refuse(answer, status_for(err), err)
            return True
        except FleetShiftError as err:
            self._count(metrics, start, ok=False)
            answer.ClearField("route")
            _refuse(answer, status_for(err), err)
            return True
        except Exception:
            self._count(metrics, start, ok=False)
            log.exception("unexpected error routing request %d of a RouteStream", item.id)
            answer.ClearField("route")
            answer.error.code = grpc.StatusCode.INTERNAL.value[0]
            answer.error.message = "internal error in Route"
            return True
        self._count(metrics, start, ok=True)
        return True

    @staticmethod
    def _count(metrics: DaemonMetrics | None, start: float, *, ok: bool) -> None:
        """What ``metrics.time_route`` records, without its context manager's cost."""
        if metrics is not None:
            metrics.route_done(perf_counter() - start, ok=ok)

    async def _stream_answer(self, item: pb.RouteStreamItem, answer: pb.RouteStreamAnswer) -> None:
        try:
            # The bounds the RequestBounds interceptor checks before a unary Route (it sees a
            # stream's messages only as they come, so the check is made here, per request).
            check_request(item.route)
            if self._metrics is None:
                routed = await self._route_or_catch_up(item.route)
            else:
                with self._metrics.time_route():
                    routed = await self._route_or_catch_up(item.route)
            answer.route.CopyFrom(routed)
        except FleetShiftError as err:
            _refuse(answer, status_for(err), err)
        except Exception:
            log.exception("unexpected error routing request %d of a RouteStream", item.id)
            answer.error.code = grpc.StatusCode.INTERNAL.value[0]
            answer.error.message = "internal error in Route"

    @rpc_errors
    async def PlaceWorker(
        self, request: pb.PlaceWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlaceWorkerResponse:
        slot = self._service.place_worker(
            request.model,
            convert.role(request.role),
            request.tensor_parallel,
            convert.dtype(request.dtype),
            request.prefer_gpu_kind,
        )
        return pb.PlaceWorkerResponse(
            node_name=slot.node,
            gpu_indices=list(slot.gpu_indices),
            gpu_kind=slot.gpu_kind.name,
            reason=slot.reason,
        )


class PlanningServicer(pb_grpc.PlanningServicer):
    def __init__(self, service: PlacementService, workers: WorkerTable) -> None:
        self._service = service
        self._workers = workers

    @rpc_errors
    async def GetEfficiency(
        self, request: pb.GetEfficiencyRequest, context: grpc.aio.ServicerContext
    ) -> pb.EfficiencyReport:
        limit = min(request.history or 20, 1000)
        history = await asyncio.to_thread(self._service.efficiency_history, limit)
        settings = self._service.settings
        out = pb.EfficiencyReport(
            history=[sample_pb(s) for s in history],
            threshold=settings.threshold,
            below_threshold_for_s=self._service.below_threshold_for_s(),
            planner_enabled=settings.interval_s > 0,
            note=efficiency_note(settings.interval_s, bool(history)),
        )
        if history:
            out.latest.CopyFrom(sample_pb(history[-1]))
        out.predictions.extend(map(basis_pb, self._service.prediction_bases()))
        report = self._service.last_report
        if report is not None:
            measured = report.measured_attainment
            out.measured_slo_reported = measured is not None
            out.measured_slo_attainment = measured if measured is not None else 0.0
            out.predicted_slo_attainment = report.predicted_attainment
            out.slo_attainment_target = self._service.slo_monitor.config.target
        return out

    @rpc_errors
    async def GetTrafficMix(
        self, request: pb.GetTrafficMixRequest, context: grpc.aio.ServicerContext
    ) -> pb.TrafficMix:
        out = pb.TrafficMix(window_s=self._service.traffic.config.window_s)
        for stats, error in self._service.traffic_stats(request.model):
            out.models.add(
                model=stats.model,
                arrival_rate_per_s=stats.arrival_rate_per_s,
                prompt_tokens=pb.LengthStats(
                    mean=stats.prompt.mean, p50=stats.prompt.p50, p90=stats.prompt.p90
                ),
                output_tokens=pb.LengthStats(
                    mean=stats.output.mean, p50=stats.output.p50, p90=stats.output.p90
                ),
                prefill_decode_ratio=min(stats.prefill_decode_ratio, 1e9),
                requests_in_window=stats.requests,
                estimator_mae_tokens=0.0 if math.isnan(error.mae) else error.mae,
                estimator_samples=error.n,
                estimator_baseline_mae_tokens=(
                    0.0 if math.isnan(error.baseline_mae) else error.baseline_mae
                ),
            )
        return out

    @rpc_errors
    async def PlanRebalance(
        self, request: pb.PlanRebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.Plan:
        report = await asyncio.to_thread(self._service.preview)
        out = plan_pb(report.plan, self._service.settings.horizon_s, self._service)
        out.would_propose = report.decision.propose
        out.decision_reason = report.decision.reason
        out.predictions.extend(map(basis_pb, self._service.prediction_bases()))
        return out

    @rpc_errors
    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        workers = self._workers.all(request.node_name or None, request.model or None)
        return pb.ListWorkersResponse(
            workers=[convert.with_engine(convert.worker_pb(w), self._service) for w in workers]
        )


def bindings(
    service: PlacementService,
    workers: WorkerTable,
    metrics: DaemonMetrics | None = None,
    catch_up: Callable[[], Awaitable[bool]] = no_catch_up,
) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            pb_grpc.add_PlacementServicer_to_server,
            PlacementServicer(service, metrics, catch_up),
            pb.DESCRIPTOR.services_by_name["Placement"].full_name,
        ),
        ServiceBinding(
            pb_grpc.add_PlanningServicer_to_server,
            PlanningServicer(service, workers),
            pb.DESCRIPTOR.services_by_name["Planning"].full_name,
        ),
    ]
