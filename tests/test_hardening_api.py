"""Refusals a caller can act on, against the real daemon over gRPC (issue 13 items 4, 13).

Undecodable bytes are INVALID_ARGUMENT with a plain sentence on every method of every daemon
service (grpc alone answers UNKNOWN naming ``DecodeError``), and an efficiency report says why
it is empty instead of being silently blank.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2, operations_pb2, placement_pb2
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_common.config import DaemonConfig, PlannerSettings
from fleetshift_daemon.app import Daemon

SERVICES = [
    fleet_pb2.DESCRIPTOR.services_by_name["AgentRegistry"],
    fleet_pb2.DESCRIPTOR.services_by_name["FleetOperator"],
    placement_pb2.DESCRIPTOR.services_by_name["Placement"],
    placement_pb2.DESCRIPTOR.services_by_name["Planning"],
    operations_pb2.DESCRIPTOR.services_by_name["Operations"],
]
METHODS = [f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods]
STREAMING = {f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods if m.server_streaming}
GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: no such wire type


@pytest.mark.parametrize("method", METHODS)
async def test_undecodable_bytes_are_invalid_argument_everywhere(
    daemon: Daemon, method: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        make = ch.unary_stream if method in STREAMING else ch.unary_unary
        call = make(method, request_serializer=None, response_deserializer=None)(GARBAGE)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if method in STREAMING:
                async for _ in call:
                    pass
            else:
                await call
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid" in err.value.details()
    assert "DecodeError" not in err.value.details()


@pytest.fixture
async def planner_off(tmp_path: Path, sqlite_url: str) -> AsyncIterator[Daemon]:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        planner=PlannerSettings(interval_s=0),
    )
    daemon = Daemon(config)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop(0.1)


async def test_efficiency_says_plainly_that_the_planner_is_off(planner_off: Daemon) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{planner_off.port}") as ch:
        report = await pb_grpc.PlanningStub(ch).GetEfficiency(placement_pb2.GetEfficiencyRequest())
    assert not report.planner_enabled and not report.HasField("latest")
    assert "the planner is off (planner.interval_s = 0)" in report.note


async def test_efficiency_before_the_first_pass_says_so(daemon: Daemon) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        report = await pb_grpc.PlanningStub(ch).GetEfficiency(placement_pb2.GetEfficiencyRequest())
    assert report.planner_enabled
    assert report.HasField("latest") or "no planning pass has run yet" in report.note
