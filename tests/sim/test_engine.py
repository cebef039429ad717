"""The simulator's timing, determinism and bookkeeping, checked against the perf model itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetshift_daemon.core.perfmodel import Dtype, PerfModel, llama2_70b
from fleetshift_daemon.sim.engine import SimConfig, Simulator
from fleetshift_daemon.sim.fleet import NodeGroup, SimFleet
from fleetshift_daemon.sim.metrics import check_conservation, summarize
from fleetshift_daemon.sim.policies import LeastLoaded, RoundRobin, StaticSplit
from fleetshift_daemon.sim.trace import Trace, load_trace, synthetic_trace

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
AZURE = SHARED / "traces" / "azure_llm_2023_conv.csv"


def one_node(gpu: str = "H100-SXM", tp: int = 8) -> SimFleet:
    return SimFleet(llama2_70b(), Dtype.BF16, (NodeGroup(gpu, 1, 8, tp),))


def trace_of(rows: list[tuple[float, int, int]]) -> Trace:
    a = np.array([r[0] for r in rows])
    return Trace(a, np.array([r[1] for r in rows]), np.array([r[2] for r in rows]))


def reference_colocated(trace: Trace, fleet: SimFleet) -> np.ndarray:
    """Finish times on one colocated instance, stepping token by token (slow, obvious)."""
    model = PerfModel()
    dep = fleet.deployment(fleet.groups[0])
    t = 0.0
    nxt = 0
    waiting: list[int] = []
    running: dict[int, list[int]] = {}  # req -> [tokens left, context]
    finish = np.full(len(trace), np.nan)
    while nxt < len(trace) or waiting or running:
        while nxt < len(trace) and trace.arrival_s[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        if not waiting and not running:
            t = float(trace.arrival_s[nxt])
            continue
        dt = 0.0
        admitted = list(waiting)
        waiting.clear()
        if admitted:
            dt += model.prefill_time_s(dep, [int(trace.prompt_tokens[r]) for r in admitted])
        if running:
            ctx = sum(v[1] for v in running.values())
            dt += model.decode_step_time_s(dep, len(running), ctx)
        t += dt
        for r in list(running):
            running[r][0] -= 1
            running[r][1] += 1
            if running[r][0] == 0:
                finish[r] = t
                del running[r]
        for r in admitted:
            o = int(trace.output_tokens[r])
            if o == 1:
                finish[r] = t
            else:
                running[r] = [o - 1, int(trace.prompt_tokens[r]) + 1]
    return finish


def test_a_lone_request_takes_its_unloaded_time() -> None:
    fleet = one_node()
    trace = trace_of([(0.0, 1000, 20)])
    sim = Simulator(fleet, trace, RoundRobin()).run()
    model = PerfModel()
    dep = fleet.deployment(fleet.groups[0])
    ttft = model.prefill_time_s(dep, [1000])
    steps = sum(model.decode_step_time_s(dep, 1, 1001 + i) for i in range(19))
    assert sim.log.first_token_s[0] == pytest.approx(ttft, rel=1e-9)
    assert sim.log.finish_s[0] == pytest.approx(ttft + steps, rel=1e-6)


def test_batched_steps_match_a_token_by_token_reference() -> None:
    rng = np.random.default_rng(7)
    n = 40
    arrival = np.sort(rng.uniform(0, 20, n))
    trace = Trace(arrival, rng.integers(50, 2000, n), rng.integers(1, 300, n))
    fleet = one_node()
    sim = Simulator(fleet, trace, RoundRobin(), config=SimConfig(prefill_token_budget=10**9)).run()
    expected = reference_colocated(trace, fleet)
    np.testing.assert_allclose(sim.log.finish_s, expected, rtol=1e-6)


def test_same_seed_same_result() -> None:
    trace = load_trace(AZURE).head(1500).rate_scaled(3.0, seed=5)
    fleet = SimFleet(
        llama2_70b(),
        Dtype.BF16,
        (NodeGroup("A100-SXM-80GB", 1, 8, 8), NodeGroup("H100-SXM", 1, 8, 8)),
    )
    runs = [summarize(Simulator(fleet, trace, StaticSplit()).run(), "split") for _ in range(2)]
    a, b = (r.as_dict() for r in runs)
    for d in (a, b):
        d.pop("sim_wall_s")
    assert a == b


@pytest.mark.parametrize("policy", [RoundRobin, LeastLoaded, StaticSplit])
def test_every_request_finishes_with_the_tokens_it_asked_for(policy: type) -> None:
    trace = load_trace(AZURE).head(800).time_compressed(4.0)
    fleet = SimFleet(
        llama2_70b(),
        Dtype.BF16,
        (NodeGroup("A100-SXM-80GB", 1, 8, 4), NodeGroup("H200-SXM", 1, 8, 4)),
    )
    sim = Simulator(fleet, trace, policy()).run()
    check_conservation(sim)
    assert not sim.log.dropped.any()
    np.testing.assert_array_equal(sim.log.tokens_out, trace.output_tokens)
    for inst in sim.instances:
        assert inst.kv_used == 0 and inst.batch == 0


def test_a_request_larger_than_any_kv_cache_is_counted_dropped() -> None:
    fleet = one_node("A100-SXM-80GB", tp=4)
    cap = PerfModel().kv_capacity_tokens(fleet.deployment(fleet.groups[0]))
    trace = trace_of([(0.0, 100, 10), (1.0, cap, 10), (2.0, 100, 10)])
    sim = Simulator(fleet, trace, LeastLoaded()).run()
    check_conservation(sim)
    assert list(sim.log.dropped) == [False, True, False]
    s = summarize(sim, "ll")
    assert s.dropped == 1 and s.finished == 2 and s.slo_met <= 2


def test_the_split_hands_kv_to_the_decode_pool_over_the_network() -> None:
    fleet = SimFleet(
        llama2_70b(),
        Dtype.BF16,
        (NodeGroup("H100-SXM", 1, 8, 8), NodeGroup("H200-SXM", 1, 8, 8)),
    )
    trace = synthetic_trace(50, 0.5, prompt_tokens=1500, output_tokens=100, seed=1)
    sim = Simulator(fleet, trace, StaticSplit()).run()
    check_conservation(sim)
    assert set(sim.log.prefill_inst) == {0} and set(sim.log.decode_inst) == {1}
    kv = PerfModel().kv_bytes_per_token(fleet.deployment(fleet.groups[0]))
    transfer = sim.transfer_s(sim.instances[0], sim.instances[1], 1501)
    assert transfer == pytest.approx(1e-3 + 1501 * kv / (8 * 50e9))


def test_least_loaded_sees_the_prompt_being_prefilled() -> None:
    fleet = SimFleet(llama2_70b(), Dtype.BF16, (NodeGroup("H100-SXM", 1, 8, 4),))
    trace = trace_of([(0.0, 8000, 10), (0.1, 100, 10)])  # the first prefill lasts > 0.1 s
    sim = Simulator(fleet, trace, LeastLoaded()).run()
    assert list(sim.log.prefill_inst) == [0, 1]
