"""Measured SLO attainment reaches the operator: heartbeats in, GetEfficiency and /metrics out.

Issue 11's alarm on reality: the workers' own TTFT/TBT percentiles say requests miss their
SLO while the model is content; the daemon must say so beside its efficiency figure. Real
daemon, real gRPC, real heartbeats of declared workers (the fixtures of test_placement_api).
"""

from __future__ import annotations

import asyncio

import grpc

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift_daemon.app import Daemon

from .clock import ManualClock
from .test_placement_api import (
    MODEL,
    WORKERS,
    clock,
    fleet_daemon,
    planner_settings,
    route_decode_heavy,
    stubs,
)

__all__ = ["clock", "fleet_daemon", "planner_settings", "stubs"]  # fixtures


async def slow_heartbeat(
    agents: fpb_grpc.AgentRegistryStub, node: str, ttft_p50: float, ttft_p99: float
) -> None:
    """The node's workers serving, with the TTFT percentiles they measured."""
    statuses = [
        fpb.WorkerStatus(
            worker_id=wid,
            model=MODEL,
            role=role,
            tensor_parallel=tp,
            dtype="bf16",
            gpu_indices=list(range(tp)),
            endpoint=f"127.0.0.1:{9000 + len(wid)}",
            state=fpb.WORKER_STATE_SERVING,
            counters=fpb.WorkerCounters(
                worker_id=wid,
                kv_blocks_total=100_000,
                live_sessions=4,
                ttft_p50_ms=ttft_p50,
                ttft_p99_ms=ttft_p99,
                tbt_p50_ms=20.0,
                tbt_p99_ms=40.0,
            ),
        )
        for wid, role, tp in WORKERS[node]
    ]
    await agents.Heartbeat(fpb.HeartbeatRequest(node_name=node, workers=statuses))


async def _report_after(planning, since: float) -> pb.EfficiencyReport:  # type: ignore[no-untyped-def]
    for _ in range(100):
        report = await planning.GetEfficiency(pb.GetEfficiencyRequest(history=1))
        if report.measured_slo_reported and report.latest.taken_at.ToSeconds() >= int(since):
            return report
        await asyncio.sleep(0.05)
    raise AssertionError("no planning pass reported measured attainment")


async def test_measured_misses_are_published_beside_efficiency_and_in_the_metrics(
    stubs, fleet_daemon: Daemon, clock: ManualClock
) -> None:  # type: ignore[no-untyped-def]
    placement, planning = stubs
    await route_decode_heavy(placement, 30)
    clock.advance(2.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet_daemon.port}") as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        for node in WORKERS:  # well inside the 2 s TTFT SLO
            await slow_heartbeat(agents, node, 300.0, 900.0)
        good = await _report_after(planning, clock())
        assert good.measured_slo_attainment >= good.slo_attainment_target == 0.99
        clock.advance(1.0)
        for node in WORKERS:  # the same workers now take seconds to the first token
            await slow_heartbeat(agents, node, 3000.0, 9000.0)
        bad = await _report_after(planning, clock())
    # over the window (the good round is still in it), far below the target the alert uses
    assert bad.measured_slo_attainment < bad.slo_attainment_target
    assert bad.measured_slo_attainment < good.measured_slo_attainment - 0.3
    assert 0.0 <= bad.predicted_slo_attainment <= 1.0  # the model's figure stands beside it
    gauge = fleet_daemon.metrics.registry.get_sample_value(
        "fleetshift_slo_attainment_measured", {"model": MODEL}
    )
    target = fleet_daemon.metrics.registry.get_sample_value(
        "fleetshift_slo_attainment_target", {"model": MODEL}
    )
    assert gauge is not None and target == 0.99 and gauge < target  # what the alert compares
