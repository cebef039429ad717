"""Route, PlaceWorker, efficiency and dry-run plans through the real gRPC API.

Agents are played by real gRPC clients that register declared nodes and heartbeat declared
workers of a Llama-2-70B-class model, exactly as a node agent reports them; the daemon, its
database, router and planner are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import fleet_pb2_grpc as fpb_grpc
from fleetshift.v1 import placement_pb2 as pb
from fleetshift.v1 import placement_pb2_grpc as pb_grpc
from fleetshift.v1 import worker_pb2
from fleetshift_common.config import DaemonConfig, ModelConfig, PlannerSettings
from fleetshift_daemon.api.placement import plan_pb
from fleetshift_daemon.app import Daemon
from fleetshift_rpc.sessions import routed_session

from .clock import ManualClock

GiB = 1024**3
MODEL = "llama-70b"
NODES = {"h100-1": "NVIDIA H100 80GB HBM3", "h200-1": "NVIDIA H200"}
# The wrong placement for decode-heavy traffic: decode on H100, prefill on H200.
WORKERS = {
    "h100-1": [("dec-h100", fpb.WORKER_ROLE_DECODE, 4)],
    "h200-1": [("pre-h200", fpb.WORKER_ROLE_PREFILL, 4)],
}


async def heartbeat(agents: fpb_grpc.AgentRegistryStub, node: str) -> None:
    """What the node's agent reports: its workers, serving."""
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
            counters=fpb.WorkerCounters(worker_id=wid, kv_blocks_total=100_000),
        )
        for wid, role, tp in WORKERS[node]
    ]
    await agents.Heartbeat(fpb.HeartbeatRequest(node_name=node, workers=statuses))


async def route_decode_heavy(placement: pb_grpc.PlacementStub, requests: int) -> None:
    """What the fleet's router asks for a decode-heavy mix: short prompts, long answers."""
    for _ in range(requests):
        await placement.Route(
            pb.RouteRequest(model=MODEL, prompt_tokens=128, expected_output_tokens=1500)
        )


@pytest.fixture
def clock() -> ManualClock:
    """The daemon's clock: traffic rates are requests over the seconds the test lets pass,
    not over however long a loaded runner took to send them."""
    return ManualClock(time.time())


@pytest.fixture
def planner_settings() -> PlannerSettings:
    """A pass every 0.3 s, proposing at once (a test may parametrize other settings)."""
    return PlannerSettings(interval_s=0.3, threshold=0.95, hold_s=0.0, horizon_s=3600)


@pytest.fixture
async def fleet_daemon(
    tmp_path: Path, sqlite_url: str, clock: ManualClock, planner_settings: PlannerSettings
) -> AsyncIterator[Daemon]:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        state_dir=str(tmp_path),
        database_url=sqlite_url,
        heartbeat_interval_s=0.2,
        node_lost_after_s=5.0,
        liveness_check_interval_s=0.2,
        models=(ModelConfig(name=MODEL, preset="llama2-70b", tp_options=(4, 8)),),
        planner=planner_settings,
    )
    daemon = Daemon(config, clock=clock)
    await daemon.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        agents = fpb_grpc.AgentRegistryStub(ch)
        for node, product in NODES.items():
            gpus = [fpb.Gpu(index=i, product_name=product, memory_bytes=80 * GiB) for i in range(8)]
            await agents.RegisterNode(
                fpb.RegisterNodeRequest(
                    node_name=node,
                    agent_address="127.0.0.1:1",
                    gpus=gpus,
                    inventory_source=fpb.INVENTORY_SOURCE_DECLARED,
                )
            )
            await heartbeat(agents, node)
    try:
        yield daemon
    finally:
        await daemon.stop(0.1)


@pytest.fixture
async def stubs(fleet_daemon: Daemon):  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet_daemon.port}") as ch:
        yield pb_grpc.PlacementStub(ch), pb_grpc.PlanningStub(ch)


async def test_workers_reported_in_heartbeats_are_listed(stubs) -> None:  # type: ignore[no-untyped-def]
    _, planning = stubs
    listed = await planning.ListWorkers(pb.ListWorkersRequest())
    assert {w.worker_id: w.role for w in listed.workers} == {
        "dec-h100": fpb.WORKER_ROLE_DECODE,
        "pre-h200": fpb.WORKER_ROLE_PREFILL,
    }
    only_h200 = await planning.ListWorkers(pb.ListWorkersRequest(node_name="h200-1"))
    assert [w.worker_id for w in only_h200.workers] == ["pre-h200"]
    # issue 13 item 6: where each worker runs
    assert {w.worker_id: w.node_name for w in listed.workers} == {
        "dec-h100": "h100-1",
        "pre-h200": "h200-1",
    }


async def test_cli_workers_table_shows_the_node(
    fleet_daemon: Daemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleetshift_daemon.cli.main import main as cli

    monkeypatch.setenv("COLUMNS", "200")
    address = f"127.0.0.1:{fleet_daemon.port}"
    assert await asyncio.to_thread(cli, ["--daemon", address, "workers"]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if "-h" in line}
    assert "h100-1" in rows["dec-h100"] and "h200-1" in rows["pre-h200"]


async def test_route_answers_with_a_worker_and_feeds_the_traffic_mix(stubs) -> None:  # type: ignore[no-untyped-def]
    placement, planning = stubs
    reply = await placement.Route(
        pb.RouteRequest(model=MODEL, prompt_tokens=200, expected_output_tokens=900)
    )
    assert reply.worker_id in {"dec-h100", "pre-h200"}
    assert reply.endpoint.startswith("127.0.0.1:")
    assert reply.reason and reply.terms.total > 0
    assert reply.output_tokens == 900 and not reply.output_estimated
    # Split pool: the prefill goes to the prefill worker, decode to the decode worker.
    assert (reply.worker_id, reply.decode_worker_id) == ("pre-h200", "dec-h100")

    estimated = await placement.Route(pb.RouteRequest(model=MODEL, prompt_tokens=300))
    assert estimated.output_estimated and estimated.output_tokens > 0

    mix = await planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))
    assert [m.model for m in mix.models] == [MODEL]
    assert mix.models[0].requests_in_window == 2
    assert mix.models[0].prompt_tokens.mean == pytest.approx(250)


async def test_a_request_routed_again_counts_once_in_the_traffic_mix(
    stubs, fleet_daemon: Daemon
) -> None:  # type: ignore[no-untyped-def]
    _, planning = stubs

    def routed() -> float:
        sample = ("fleetshift_routes_total", {"outcome": "routed"})
        return fleet_daemon.metrics.registry.get_sample_value(*sample) or 0.0

    before = routed()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet_daemon.port}") as daemon:
        session = routed_session(
            daemon,
            pb.RouteRequest(model=MODEL, prompt_tokens=100, expected_output_tokens=50),
            worker_pb2.GenerateRequest(prompt_tokens=[1, 2, 3], max_new_tokens=5),
            reroute_timeout_s=0.5,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in session:
                pass
    # No declared worker listens: every worker refuses, and the client routes again each time.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert routed() - before >= 3
    mix = await planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))
    assert mix.models[0].requests_in_window == 1


async def test_decode_heavy_mix_shows_the_gap_and_plans_decode_onto_h200(
    stubs, fleet_daemon: Daemon, clock: ManualClock
) -> None:  # type: ignore[no-untyped-def]
    placement, planning = stubs
    await route_decode_heavy(placement, 60)
    clock.advance(2.0)  # 30 requests/s, 45k output tokens/s
    plan = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    assert plan.solver_status == "optimal" and plan.solve_s > 0
    assert 0 < plan.efficiency_before < 1
    assert plan.goodput_after_tokens_per_s > plan.goodput_before_tokens_per_s
    decode_targets = {
        m.target.gpu_kind
        for m in plan.moves
        if m.HasField("target") and m.target.role == fpb.WORKER_ROLE_DECODE
    }
    assert decode_targets == {"H200-SXM"}
    # The periodic job publishes the same figure and keeps its history.
    for _ in range(50):
        report = await planning.GetEfficiency(pb.GetEfficiencyRequest(history=5))
        if report.history and report.latest.efficiency < 1:
            break
        await asyncio.sleep(0.1)
    # (The figure moves with the window's arrival rate, so it is not compared to the dry run.)
    assert 0 < report.latest.efficiency < 1
    assert report.latest.best_goodput_tokens_per_s > report.latest.current_goodput_tokens_per_s
    assert report.threshold == 0.95 and len(report.history) >= 1
    assert report.latest.plan_proposed


async def test_planning_goes_on_without_a_lost_node_and_plans_around_it(
    stubs, fleet_daemon: Daemon, clock: ManualClock
) -> None:  # type: ignore[no-untyped-def]
    placement, planning = stubs
    await route_decode_heavy(placement, 60)
    clock.advance(6.0)  # past node_lost_after_s; only the H200 node's agent reports again
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet_daemon.port}") as ch:
        await heartbeat(fpb_grpc.AgentRegistryStub(ch), "h200-1")
        operator = fpb_grpc.FleetOperatorStub(ch)
        for _ in range(100):
            lost = await operator.ListNodes(fpb.ListNodesRequest(state=fpb.NODE_STATE_LOST))
            if lost.nodes:
                break
            await asyncio.sleep(0.05)
    assert [n.name for n in lost.nodes] == ["h100-1"]
    lost_at = clock()

    plan = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    # The lost node's decode worker is neither moved nor counted: the plan fills the shortfall
    # on the node that is left.
    assert plan.moves and plan.goodput_after_tokens_per_s > plan.goodput_before_tokens_per_s
    for move in plan.moves:
        for side in (move.source, move.target):
            assert side.worker_id != "dec-h100" and side.node_name != "h100-1", move
    assert {m.target.role for m in plan.moves} & {fpb.WORKER_ROLE_DECODE, fpb.WORKER_ROLE_MIXED}
    # The periodic pass keeps publishing after the loss. Passes run one at a time and read the
    # manual clock, so a pass stamped after a second advance began after one stamped after the
    # first had ended, hence after the loss: no pass planned before the loss can be the one read.
    for step in (1, 2):
        clock.advance(1.0)
        for _ in range(100):
            report = await planning.GetEfficiency(pb.GetEfficiencyRequest(history=1))
            if report.latest.taken_at.ToSeconds() >= int(lost_at) + step:
                break
            await asyncio.sleep(0.1)
        assert report.latest.taken_at.ToSeconds() >= int(lost_at) + step
    # A prefill worker alone completes no request: nothing is served until the plan runs.
    assert report.latest.efficiency == 0.0 and report.latest.plan_proposed
    assert report.latest.best_goodput_tokens_per_s > 0


async def test_place_worker_prefers_the_gpu_kind_that_fits_the_role(stubs) -> None:  # type: ignore[no-untyped-def]
    placement, _ = stubs
    decode = await placement.PlaceWorker(
        pb.PlaceWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_DECODE, tensor_parallel=4)
    )
    assert decode.gpu_kind == "H200-SXM" and decode.node_name == "h200-1"
    assert len(decode.gpu_indices) == 4 and not set(decode.gpu_indices) & set(range(8)) - {
        4,
        5,
        6,
        7,
    }
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await placement.PlaceWorker(
            pb.PlaceWorkerRequest(model=MODEL, role=fpb.WORKER_ROLE_DECODE, tensor_parallel=3)
        )
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "tensor_parallel" in err.value.details()
    )


BAD_ROUTES = [
    (pb.RouteRequest(model="gpt-nope", prompt_tokens=10), grpc.StatusCode.NOT_FOUND, "model"),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_tokens",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=-5),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_tokens",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=10, expected_output_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected_output_tokens",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=10, slo=pb.Slo(ttft_ms=0, tbt_ms=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "slo.ttft_ms",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=10, slo=pb.Slo(ttft_ms=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "slo.ttft_ms",
    ),
    # Issue 13 item 1: the lengths and SLOs one call could poison the traffic mix with.
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=2**63 - 1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_tokens must be >= 1 and <= 1_048_576 tokens",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=10, expected_output_tokens=2**63 - 1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected_output_tokens must be >= 1 and <= 1_048_576 tokens",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=4097),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_tokens must be <= 4096 (the context of model 'llama-70b')",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=10, slo=pb.Slo(ttft_ms=1e308)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "slo.ttft_ms must be >= 0.001 and <= 3_600_000 ms",
    ),
    (
        pb.RouteRequest(model=MODEL, prompt_tokens=10, slo=pb.Slo(tbt_ms=float("nan"))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "slo.tbt_ms",
    ),
]


@pytest.mark.parametrize(("request_msg", "code", "named"), BAD_ROUTES)
async def test_bad_route_requests_are_refused_by_field(stubs, request_msg, code, named) -> None:  # type: ignore[no-untyped-def]
    placement, planning = stubs
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await placement.Route(request_msg)
    assert err.value.code() == code
    assert named in err.value.details()
    mix = await planning.GetTrafficMix(pb.GetTrafficMixRequest())
    assert all(m.requests_in_window == 0 for m in mix.models)  # nothing was counted


async def test_an_unknown_preferred_worker_is_a_hint_never_a_filter(stubs) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 5: a stale session-affinity hint must not fail the request."""
    placement, planning = stubs
    for hint in ("ghost", "stopped-worker-42"):
        reply = await placement.Route(
            pb.RouteRequest(model=MODEL, prompt_tokens=100, preferred_worker_id=hint)
        )
        assert reply.worker_id in {"dec-h100", "pre-h200"}
    mix = await planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))
    assert mix.models[0].requests_in_window == 2


async def test_one_caller_cannot_move_the_traffic_mix_beyond_the_context(stubs) -> None:  # type: ignore[no-untyped-def]
    """Issue 13 item 1: the largest claim a valid call can make moves the window by at most
    the model's context; the planner still sees live workers and a finite goodput."""
    placement, planning = stubs
    await route_decode_heavy(placement, 20)
    before = (await planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))).models[0]
    await placement.Route(
        pb.RouteRequest(model=MODEL, prompt_tokens=4096, expected_output_tokens=4096)
    )
    after = (await planning.GetTrafficMix(pb.GetTrafficMixRequest(model=MODEL))).models[0]
    assert after.requests_in_window == before.requests_in_window + 1
    # the claimed output is clipped to what the context leaves after the prompt (0 here)
    assert after.output_tokens.mean <= before.output_tokens.mean
    assert after.prompt_tokens.mean <= before.prompt_tokens.mean + 4096 / 21
    plan = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    assert plan.goodput_before_tokens_per_s > 0


async def test_operator_gets_a_dry_run_plan_with_grpcurl(
    fleet_daemon: Daemon, grpcurl: str, clock: ManualClock
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet_daemon.port}") as ch:
        await route_decode_heavy(pb_grpc.PlacementStub(ch), 30)
    clock.advance(1.0)
    result = await asyncio.to_thread(
        subprocess.run,
        [
            grpcurl,
            "-plaintext",
            "-d",
            "{}",
            f"127.0.0.1:{fleet_daemon.port}",
            "fleetshift.v1.Planning/PlanRebalance",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["moves"] and 0 < plan["efficiency_before"] < 1
    assert plan["solver_status"] == "optimal", plan["solver_status"]
    assert {m["kind"] for m in plan["moves"]} <= {
        "MOVE_KIND_ROLE_CHANGE",
        "MOVE_KIND_MIGRATE",
        "MOVE_KIND_COLD_START",
        "MOVE_KIND_START",
        "MOVE_KIND_STOP",
    }


def _steps(plan: pb.Plan) -> list[tuple[object, ...]]:
    """What a plan would do: each move's kind, worker and destination."""
    return [
        (m.kind, m.model, m.source.worker_id, m.target.role, m.target.gpu_kind, m.target.node_name)
        for m in plan.moves
    ]


# The job off: the test runs the periodic pass itself (``run_cycle``, what the job calls), so
# no pass falls between the dry run and the pass it is compared with; a 60 s gate hold.
@pytest.mark.parametrize(
    "planner_settings",
    [PlannerSettings(interval_s=0, threshold=0.95, hold_s=60.0, horizon_s=3600)],
)
async def test_dry_run_on_bursty_traffic_names_the_steps_the_next_pass_takes(
    stubs, fleet_daemon: Daemon, clock: ManualClock
) -> None:  # type: ignore[no-untyped-def]
    placement, planning = stubs
    service = fleet_daemon.placement
    assert service is not None
    # one burst of 40 decode-heavy requests, then 4 quiet seconds (10 requests/s on average)
    await route_decode_heavy(placement, 40)
    clock.advance(4.0)
    first = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    again = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    assert _steps(first) == _steps(again) and first.decision_reason == again.decision_reason
    assert not (await planning.GetEfficiency(pb.GetEfficiencyRequest())).history  # none recorded

    clock.advance(3.0)  # the pass comes later: the operator's questions started no clock
    async with grpc.aio.insecure_channel(f"127.0.0.1:{fleet_daemon.port}") as ch:
        for node in NODES:  # the agents keep reporting (the nodes stay READY)
            await heartbeat(fpb_grpc.AgentRegistryStub(ch), node)
    dry = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    report = await asyncio.to_thread(service.run_cycle)
    done = plan_pb(report.plan, service.settings.horizon_s, service)
    assert dry.moves and _steps(dry) == _steps(done)
    assert (dry.would_propose, dry.decision_reason) == (
        report.decision.propose,
        report.decision.reason,
    )
    assert report.decision.gap_since == clock()  # the gate's clock started at this pass
    efficiency = await planning.GetEfficiency(pb.GetEfficiencyRequest())
    assert len(efficiency.history) == 1 and efficiency.below_threshold_for_s == 0.0


@pytest.mark.parametrize(  # the job off: no pass changes the verdict between the two asks
    "planner_settings",
    [PlannerSettings(interval_s=0, threshold=0.95, hold_s=60.0, horizon_s=3600)],
)
async def test_cli_plan_says_whether_the_next_pass_would_propose_it(
    stubs, fleet_daemon: Daemon, clock: ManualClock, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    from fleetshift_daemon.cli.main import main as cli

    placement, planning = stubs
    await route_decode_heavy(placement, 30)
    clock.advance(1.0)
    plan = await planning.PlanRebalance(pb.PlanRebalanceRequest())
    assert plan.decision_reason
    address = f"127.0.0.1:{fleet_daemon.port}"
    assert await asyncio.to_thread(cli, ["--daemon", address, "plan"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    verdict = "would propose it now" if plan.would_propose else "would hold it"
    assert f"the periodic pass {verdict}:" in out
