"""Output lengths learned from heartbeats, through the real daemon's gRPC API.

An agent is played by a real gRPC client that heartbeats a declared worker of a
Llama-2-70B-class model (context 4,096) with the sessions that finished on it, exactly as a
node agent relays them (``WorkerStatus.finished_sessions``). The daemon, its estimator, Route
and GetTrafficMix are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift_agent.membership import Backoff, Membership
from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.app import Daemon

from .clock import ManualClock

GiB = 1024**3
MODEL = "llama-70b"
NODE = "h100-1"
PRIOR = 256.0  # the estimator's answer for a model it has learned nothing about


def status(finished: list[fpb.FinishedSession]) -> fpb.WorkerStatus:
    return fpb.WorkerStatus(
        worker_id="w1",
        model=MODEL,
        role=fpb.WORKER_ROLE_MIXED,
        tensor_parallel=4,
        dtype="bf16",
        gpu_indices=[0, 1, 2, 3],
        endpoint="127.0.0.1:9001",
        state=fpb.WORKER_STATE_SERVING,
        counters=fpb.WorkerCounters(worker_id="w1", kv_blocks_total=100_000),
        finished_sessions=finished,
    )


def finished(n: int, prompt: int = 300, output: int = 1800, first: int = 0) -> list:  # type: ignore[type-arg]
    return [
        fpb.FinishedSession(
            session_id=f"s{first + i}",
            prompt_tokens=prompt,
            output_tokens=output,
            finish_reason="stop",
        )
        for i in range(n)
    ]


def registration() -> fpb.RegisterNodeRequest:
    gpus = [
        fpb.Gpu(index=i, product_name="NVIDIA H100 80GB HBM3", memory_bytes=80 * GiB)
        for i in range(8)
    ]
    return fpb.RegisterNodeRequest(
        node_name=NODE,
        agent_address="127.0.0.1:1",
        gpus=gpus,
        inventory_source=fpb.INVENTORY_SOURCE_DECLARED,
    )


@pytest.fixture
async def daemon(tmp_path: Path, sqlite_url: str) -> AsyncIterator[Daemon]:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=30.0,
        liveness_check_interval_s=0.2,
        models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4, 8)),),
        planner=PlannerSettings(interval_s=0.0),
    )
    d = Daemon(config, clock=ManualClock(time.time()))
    await d.start()
    try:
        yield d
    finally:
        await d.stop(0.1)


@pytest.fixture
async def stubs(daemon: Daemon):  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        await agents.RegisterNode(registration())
        await agents.Heartbeat(fpb.HeartbeatRequest(node_name=NODE, workers=[status([])]))
        yield agents, Api(pb_grpc.PlacementStub(ch), pb_grpc.PlanningStub(ch))


@dataclass(frozen=True)
class Api:
    placement: pb_grpc.PlacementStub
    planning: pb_grpc.PlanningStub


async def estimate(api: Api, prompt: int = 300) -> float:
    routed = await api.placement.Route(pb.RouteRequest(model=MODEL, prompt_tokens=prompt))
    assert routed.output_estimated
    return routed.output_tokens


async def samples(api: Api) -> int:
    mix = await api.planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))
    return {m.model: m.estimator_samples for m in mix.models}.get(MODEL, 0)


async def test_route_estimates_what_heartbeats_reported_once_each(stubs) -> None:  # type: ignore[no-untyped-def]
    agents, placement = stubs
    assert await estimate(placement) == PRIOR
    beat = fpb.HeartbeatRequest(node_name=NODE, workers=[status(finished(30))])
    await agents.Heartbeat(beat)
    # Route without expected_output_tokens now answers what this prompt bucket produced.
    assert await estimate(placement) == pytest.approx(1800.0)
    assert await samples(placement) == 30
    # The same heartbeat again (the agent resends after a lost answer; the worker repeats its
    # recent completions in every heartbeat): nothing is counted twice.
    await agents.Heartbeat(beat)
    await agents.Heartbeat(fpb.HeartbeatRequest(node_name=NODE, workers=[status(finished(5))]))
    assert await samples(placement) == 30
    # New sessions are: another bucket (short prompts, short answers) learns on its own.
    await agents.Heartbeat(
        fpb.HeartbeatRequest(
            node_name=NODE, workers=[status(finished(25, prompt=40, output=20, first=100))]
        )
    )
    assert await samples(placement) == 55
    assert await estimate(placement, prompt=40) == pytest.approx(20.0)
    assert await estimate(placement) == pytest.approx(1800.0)


async def test_the_error_report_counts_heartbeat_completions_in_the_cli(
    stubs,  # type: ignore[no-untyped-def]
    daemon: Daemon,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fleetshift_daemon.cli.main import main as cli

    agents, placement = stubs
    await agents.Heartbeat(
        fpb.HeartbeatRequest(node_name=NODE, workers=[status(finished(21, output=900))])
    )
    mix = await placement.planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))
    (row,) = mix.models
    assert row.estimator_samples == 21
    # Its first prediction was the prior (256) against 900; then the mean, exactly.
    assert row.estimator_mae_tokens == pytest.approx((900 - PRIOR) / 21)
    monkeypatch.setenv("COLUMNS", "200")
    address = f"127.0.0.1:{daemon.port}"
    assert await asyncio.to_thread(cli, ["--daemon", address, "traffic"]) == 0
    out = capsys.readouterr().out
    assert "completions" in out and " 21 " in out


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        (dict(prompt_tokens=-1, output_tokens=10), "finished_sessions[1].prompt_tokens"),
        (dict(prompt_tokens=10, output_tokens=-5), "finished_sessions[1].output_tokens"),
        (dict(prompt_tokens=0, output_tokens=10), "finished_sessions[1].prompt_tokens"),
        (dict(prompt_tokens=5000, output_tokens=10), "finished_sessions[1].prompt_tokens"),
        (dict(prompt_tokens=4000, output_tokens=500), "finished_sessions[1].output_tokens"),
        (dict(prompt_tokens=10, output_tokens=2_000_000), "finished_sessions[1].output_tokens"),
    ],
)
async def test_a_bad_entry_is_refused_by_name_and_changes_nothing(
    stubs,  # type: ignore[no-untyped-def]
    entry: dict[str, int],
    field: str,
) -> None:
    agents, placement = stubs
    good = finished(1)[0]
    bad = fpb.FinishedSession(session_id="bad", finish_reason="stop", **entry)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agents.Heartbeat(fpb.HeartbeatRequest(node_name=NODE, workers=[status([good, bad])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"workers[0].{field}" in (err.value.details() or "")
    # Nothing was learned, not even the good entry of the refused heartbeat.
    assert await samples(placement) == 0
    assert await estimate(placement) == PRIOR


async def test_more_entries_than_the_bound_are_refused(stubs) -> None:  # type: ignore[no-untyped-def]
    agents, placement = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agents.Heartbeat(
            fpb.HeartbeatRequest(node_name=NODE, workers=[status(finished(257))])
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "finished_sessions" in (err.value.details() or "")
    assert await samples(placement) == 0


async def test_an_agent_whose_finished_session_is_refused_keeps_its_node_alive(
    stubs,  # type: ignore[no-untyped-def]
    daemon: Daemon,
) -> None:
    """The agent's own membership loop: the refused heartbeat is sent again at once without
    finished sessions, so one impossible entry costs the estimator that report, never the
    node's liveness (which a refused heartbeat after heartbeat would)."""
    _, api = stubs
    bad = fpb.FinishedSession(
        session_id="bad", prompt_tokens=4000, output_tokens=500, finish_reason="length"
    )
    answered: list[fpb.HeartbeatRequest] = []
    membership = Membership(
        f"127.0.0.1:{daemon.port}",
        registration=registration,
        heartbeat=lambda: fpb.HeartbeatRequest(
            node_name=NODE, workers=[status([*finished(3), bad])]
        ),
        backoff=Backoff(0.05, 0.5),
        max_message_bytes=4 << 20,
        heartbeat_sent=answered.append,
    )
    task = asyncio.create_task(membership.run())
    try:
        for _ in range(200):
            if len(answered) >= 3:
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert len(answered) >= 3 and membership.registrations == 1
    assert all(not w.finished_sessions for beat in answered for w in beat.workers)
    assert await samples(api) == 0
