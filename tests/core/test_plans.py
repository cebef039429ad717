from __future__ import annotations

import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM, H200_SXM
from fleetshift_daemon.core.perfmodel import Deployment, Dtype, PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelDemand,
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.plans import (
    Hysteresis,
    HysteresisConfig,
    MoveCostModel,
    MoveKind,
    Plan,
    build_plan,
)
from fleetshift_daemon.core.routing import Role

from ..clock import ManualClock

M70 = "llama2-70b"
MODELS = [ModelSpec(llama2_70b(), tp_options=(2, 4, 8))]


def fleet() -> list[NodeCapacity]:
    return [NodeCapacity(f"h100-{i}", H100_SXM, 8) for i in range(2)] + [
        NodeCapacity(f"h200-{i}", H200_SXM, 8) for i in range(2)
    ]


def with_ids(p: Placement, sessions: int = 5) -> Placement:
    return Placement(
        tuple(
            PlacedWorker(
                w.model,
                w.role,
                w.gpu_kind,
                w.tp,
                w.dtype,
                w.node,
                f"w{i}",
                sessions,
                1000 * sessions,
            )
            for i, w in enumerate(p.workers)
        )
    )


def test_swapped_roles_are_fixed_in_place_without_moving_bytes() -> None:
    perf = PerfModel()
    planner = Planner(perf)
    prefill_heavy = [ModelDemand(M70, 100.0, 6000, 50)]
    inp = planning_input(fleet(), MODELS, prefill_heavy, default_slo=SloTarget(2000, 100))
    best = with_ids(planner.solve(inp).placement)
    flip = {Role.DECODE: Role.PREFILL, Role.PREFILL: Role.DECODE, Role.MIXED: Role.MIXED}
    current = Placement(
        tuple(
            PlacedWorker(
                w.model,
                flip[w.role],
                w.gpu_kind,
                w.tp,
                w.dtype,
                w.node,
                w.worker_id,
                w.live_sessions,
                w.kv_used_tokens,
            )
            for w in best.workers
        )
    )
    plan = build_plan(planner, perf, inp, current)
    kinds = {m.kind for m in plan.moves}
    assert kinds == {MoveKind.ROLE_CHANGE}
    assert plan.bytes_to_move == 0
    assert plan.gain_tokens_per_s > 0 and plan.efficiency_before < 0.8
    assert sum(m.predicted_gain_tokens_per_s for m in plan.moves) == pytest.approx(
        plan.gain_tokens_per_s, rel=1e-6
    )
    # a worker that stops decoding hands its sessions over; one that starts does not
    to_prefill = [m for m in plan.moves if m.target and m.target.role is Role.PREFILL]
    assert to_prefill and all(m.sessions_affected == 5 for m in to_prefill)
    assert all(m.sessions_affected == 0 for m in plan.moves if m not in to_prefill)


def test_cordoned_node_migrates_warm_to_the_same_gpu_model() -> None:
    perf = PerfModel()
    planner = Planner(perf)
    nodes = [
        NodeCapacity("h200-0", H200_SXM, 8, cordoned=True),
        NodeCapacity("h200-1", H200_SXM, 8),
    ]
    demand = [ModelDemand(M70, 2.0, 500, 300)]
    inp = planning_input(nodes, MODELS, demand, default_slo=SloTarget(2000, 100))
    current = Placement(
        (PlacedWorker(M70, Role.MIXED, "H200-SXM", 2, Dtype.BF16, "h200-0", "w1", 12, 50_000),)
    )
    plan = build_plan(planner, perf, inp, current)
    (mig,) = [m for m in plan.moves if m.worker_id == "w1"]
    assert mig.kind is MoveKind.MIGRATE
    assert mig.target is not None and mig.target.node == "h200-1"
    dep = Deployment(llama2_70b(), H200_SXM, 2)
    assert mig.bytes_to_move == perf.weight_bytes(dep) + 50_000 * perf.kv_bytes_per_token(dep)
    assert mig.sessions_affected == 12
    assert mig.expected_pause_s == MoveCostModel().cutover_s
    assert mig.cost_tokens > 0


def test_moving_to_another_gpu_model_is_a_cold_start_that_recomputes_kv() -> None:
    perf = PerfModel()
    planner = Planner(perf)
    nodes = [
        NodeCapacity("a100-0", A100_SXM_80GB, 8, cordoned=True),
        NodeCapacity("h200-0", H200_SXM, 8),
    ]
    inp = planning_input(nodes, MODELS, [ModelDemand(M70, 0.5, 500, 300)])
    current = Placement(
        (PlacedWorker(M70, Role.MIXED, "A100-SXM-80GB", 4, Dtype.BF16, "a100-0", "w1", 7, 20_000),)
    )
    plan = build_plan(planner, perf, inp, current)
    (cold,) = [m for m in plan.moves if m.worker_id == "w1"]
    assert cold.kind is MoveKind.COLD_START
    assert cold.target is not None and cold.target.gpu_kind == "H200-SXM"
    assert cold.sessions_affected == 7
    assert cold.expected_pause_s > MoveCostModel().cutover_s  # KV recomputed on the new GPUs
    assert cold.bytes_to_move == perf.weight_bytes(
        Deployment(llama2_70b(), H200_SXM, cold.target.tp)
    )
    # A cordoned node still serves what runs there: the move buys no goodput by itself, so
    # the hysteresis gate alone would never propose it (draining is the operator's call).
    assert plan.gain_tokens_per_s == pytest.approx(0.0, abs=1e-6)


def test_surplus_workers_stop_last_after_new_ones_start() -> None:
    perf = PerfModel()
    planner = Planner(perf)
    nodes = [NodeCapacity("h200-0", H200_SXM, 8), NodeCapacity("h100-0", H100_SXM, 8)]
    inp = planning_input(nodes, MODELS, [ModelDemand(M70, 0.2, 500, 300)])
    current = Placement(
        tuple(
            PlacedWorker(M70, Role.PREFILL, "H100-SXM", 2, Dtype.BF16, "h100-0", f"w{i}", 3, 900)
            for i in range(4)
        )
    )
    plan = build_plan(planner, perf, inp, current)
    kinds = [m.kind for m in plan.moves]
    assert MoveKind.STOP in kinds
    first_stop = kinds.index(MoveKind.STOP)
    assert all(k is MoveKind.STOP for k in kinds[first_stop:])  # make-before-break
    assert plan.efficiency_before < 1.0 and plan.goodput_after > plan.goodput_before


def plan_with(gain: float, cost: float) -> Plan:
    from fleetshift_daemon.core.plans import Move

    move = Move(MoveKind.START, M70, None, None, 0, 60.0, 0.0, 0, gain, cost, "x")
    return Plan((move,), 1000.0, 1000.0 + gain, 0.5)


def test_hysteresis_holds_back_a_transient_gap() -> None:
    clock = ManualClock()
    h = Hysteresis(clock, HysteresisConfig(threshold=0.1, hold_s=300, horizon_s=3600))
    good = plan_with(gain=500.0, cost=10_000.0)
    # a gap of 0.15 is 1.5x the threshold: it must hold 300 / 1.5 = 200 s
    assert not h.observe(0.85, good).propose  # gap opens
    clock.t = 150
    d = h.observe(0.85, good)
    assert not d.propose and "holding for 200 s" in d.reason
    clock.t = 190
    assert not h.observe(0.95, good).propose  # the mix came back: gap closed, timer resets
    clock.t = 400
    d = h.observe(0.85, good)
    assert not d.propose and d.gap_since == 400
    clock.t = 601
    d = h.observe(0.85, good)
    assert d.propose and "beats move cost" in d.reason


def test_hysteresis_acts_sooner_on_a_wider_gap_but_not_before_the_floor() -> None:
    clock = ManualClock()
    cfg = HysteresisConfig(threshold=0.1, hold_s=600, min_hold_s=60, horizon_s=3600)
    assert (
        cfg.hold_for(0.1) == 600
        and cfg.hold_for(0.2) == 300
        and cfg.hold_for(1.0) == pytest.approx(60.0)
    )
    h = Hysteresis(clock, cfg)
    good = plan_with(gain=500.0, cost=10_000.0)
    assert not h.observe(0.25, good).propose  # a 75 % gap: 600 * 0.1 / 0.75 = 80 s
    clock.t = 79
    assert not h.observe(0.25, good).propose
    clock.t = 81
    assert h.observe(0.25, good).propose
    with pytest.raises(InvalidArgument):
        HysteresisConfig(min_hold_s=-1)


def test_hysteresis_needs_the_gain_to_pay_for_the_moves() -> None:
    clock = ManualClock()
    h = Hysteresis(clock, HysteresisConfig(threshold=0.1, hold_s=0, horizon_s=60))
    d = h.observe(0.5, plan_with(gain=10.0, cost=1_000_000.0))
    assert not d.propose and "does not beat" in d.reason
    assert h.observe(0.5, plan_with(gain=100_000.0, cost=1_000.0)).propose
