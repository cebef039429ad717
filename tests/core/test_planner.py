from __future__ import annotations

from collections import Counter

import pytest

from fleetshift_common.errors import InvalidArgument, NotFound
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM, H200_SXM, L40S
from fleetshift_daemon.core.perfmodel import Deployment, ModelArch, PerfModel, llama2_70b
from fleetshift_daemon.core.planner import (
    ModelDemand,
    ModelSpec,
    NodeCapacity,
    PlacedWorker,
    Placement,
    Planner,
    PlannerConfig,
    SloTarget,
    planning_input,
)
from fleetshift_daemon.core.routing import Role

M70 = "llama2-70b"
SLO = SloTarget(ttft_ms=2000, tbt_ms=100)
SMALL = ModelArch("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 128)


def h100_h200_fleet() -> list[NodeCapacity]:
    return [NodeCapacity(f"h100-{i}", H100_SXM, 8) for i in range(2)] + [
        NodeCapacity(f"h200-{i}", H200_SXM, 8) for i in range(2)
    ]


def solve(nodes, demand, models=None, current=None):  # type: ignore[no-untyped-def]
    models = models or [ModelSpec(llama2_70b(), tp_options=(2, 4, 8))]
    inp = planning_input(nodes, models, demand, default_slo=SLO)
    return inp, Planner(PerfModel()).solve(inp, current)


def roles_on(placement: Placement, kind: str) -> Counter[Role]:
    return Counter(w.role for w in placement.workers if w.gpu_kind == kind)


def test_decode_heavy_traffic_puts_decode_on_the_h200s() -> None:
    _, sol = solve(h100_h200_fleet(), [ModelDemand(M70, 5.0, 200, 1500)])
    on_h200 = roles_on(sol.placement, "H200-SXM")
    # every H200 decodes (a mixed worker may also take the little prefill there is)
    assert on_h200[Role.DECODE] > 0 and on_h200[Role.PREFILL] == 0
    assert sum(w.tp for w in sol.placement.workers if w.gpu_kind == "H200-SXM") == 16
    assert sol.status == "optimal"


def test_prefill_heavy_traffic_puts_prefill_on_the_h100s() -> None:
    # A load that needs both kinds at the default headroom (10 requests/s of derated
    # capacity: 5/s at utilisation 0.5). At a fixed 5/s and utilisation 0.8 the whole demand
    # fits on the two H100 nodes, and the cheapest answer (16 H100 GPUs, $48/h, against
    # 24 GPUs with the H200s) rightly decodes on an H100: the roles' affinity is only
    # visible when the H200s are needed (fs-11c).
    rate = 10.0 * PlannerConfig().utilisation
    _, sol = solve(h100_h200_fleet(), [ModelDemand(M70, rate, 6000, 50)])
    on_h100 = roles_on(sol.placement, "H100-SXM")
    assert on_h100 and set(on_h100) == {Role.PREFILL}
    decoding = [w for w in sol.placement.workers if w.role is not Role.PREFILL]
    assert decoding and all(w.gpu_kind == "H200-SXM" for w in decoding)


def test_a_model_that_does_not_fit_is_not_placed_on_that_kind() -> None:
    nodes = [NodeCapacity(f"l40s-{i}", L40S, 2) for i in range(4)]
    nodes.append(NodeCapacity("h100-0", H100_SXM, 8))
    models = [ModelSpec(llama2_70b(), tp_options=(1, 2)), ModelSpec(SMALL, tp_options=(1, 2))]
    demand = [ModelDemand(M70, 50.0, 1000, 200), ModelDemand("llama3-8b", 50.0, 1000, 200)]
    _, sol = solve(nodes, demand, models)
    assert sol.placement.workers
    # 138 GB of weights never fit on two 48 GB L40S; the 8B model does use them
    assert not [w for w in sol.placement.workers if w.model == M70 and w.gpu_kind == "L40S"]
    assert [w for w in sol.placement.workers if w.model == "llama3-8b" and w.gpu_kind == "L40S"]
    only_l40s = nodes[:4]
    _, none = solve(only_l40s, [ModelDemand(M70, 5.0, 1000, 200)])
    assert none.placement.workers == () and none.evaluation.goodput_tokens_per_s == 0


def test_light_traffic_is_served_whole_on_the_cheapest_capable_gpus() -> None:
    nodes = [NodeCapacity("a100-0", A100_SXM_80GB, 8), NodeCapacity("h100-0", H100_SXM, 8)]
    _, sol = solve(nodes, [ModelDemand(M70, 0.2, 1000, 200)])
    ev = sol.evaluation
    assert ev.goodput_tokens_per_s == pytest.approx(ev.demand_tokens_per_s)
    assert ev.gpus_used == 2
    assert {w.gpu_kind for w in sol.placement.workers} == {"A100-SXM-80GB"}


def test_tp_groups_stay_inside_nodes_and_cordoned_nodes_stay_empty() -> None:
    nodes = [NodeCapacity(f"h200-{i}", H200_SXM, 4) for i in range(3)]
    nodes.append(NodeCapacity("h200-cordoned", H200_SXM, 8, cordoned=True))
    _, sol = solve(nodes, [ModelDemand(M70, 100.0, 1000, 500)])
    used: Counter[str] = Counter()
    for w in sol.placement.workers:
        used[w.node] += w.tp
    assert used and "h200-cordoned" not in used
    assert all(used[n.name] <= n.gpu_count for n in nodes)
    assert all(w.tp <= 4 for w in sol.placement.workers)


def test_efficiency_is_one_when_optimal_and_lower_for_a_bad_placement() -> None:
    planner = Planner(PerfModel())
    inp, best = solve(h100_h200_fleet(), [ModelDemand(M70, 100.0, 200, 1500)])
    assert planner.efficiency(inp, best.placement).efficiency == pytest.approx(1.0)
    # Same GPUs, phases swapped: H200s prefill, H100s decode.
    bad = Placement(
        tuple(
            PlacedWorker(
                M70,
                Role.PREFILL if w.gpu_kind == "H200-SXM" else Role.DECODE,
                w.gpu_kind,
                w.tp,
                w.dtype,
                w.node,
            )
            for w in best.placement.workers
        )
    )
    report = planner.efficiency(inp, bad)
    assert report.efficiency < 0.8
    assert report.current.goodput_tokens_per_s < report.best.evaluation.goodput_tokens_per_s
    assert report.best.goodput_bound_tokens_per_s >= report.best.evaluation.goodput_tokens_per_s


def test_existing_workers_keep_their_nodes_and_ids() -> None:
    inp, best = solve(h100_h200_fleet(), [ModelDemand(M70, 100.0, 200, 1500)])
    current = Placement(
        tuple(
            PlacedWorker(w.model, w.role, w.gpu_kind, w.tp, w.dtype, w.node, f"w{i}")
            for i, w in enumerate(best.placement.workers)
        )
    )
    again = Planner(PerfModel()).solve(inp, current)
    assert sorted((w.worker_id, w.node) for w in again.placement.workers) == sorted(
        (w.worker_id, w.node) for w in current.workers
    )


def test_input_errors_name_the_field() -> None:
    nodes = h100_h200_fleet()
    models = [ModelSpec(llama2_70b())]
    with pytest.raises(NotFound) as exc:
        planning_input(nodes, models, [ModelDemand("nope", 1.0, 10, 10)])
    assert exc.value.field == "demand[0].model"
    with pytest.raises(InvalidArgument) as exc2:
        planning_input(nodes, models, [ModelDemand(M70, -1.0, 10, 10)])
    assert exc2.value.field == "demand[0].arrival_rate_per_s"
    with pytest.raises(InvalidArgument) as exc3:
        planning_input(nodes, models, [], slos={M70: SloTarget(ttft_ms=0)})
    assert exc3.value.field == f"slos[{M70}].ttft_ms"


def test_demand_is_the_offered_load_and_counters_only_raise_lengths() -> None:
    from fleetshift_daemon.core.traffic import TrafficMonitor

    def demand(processed_in: int, processed_out: int) -> ModelDemand:
        t = [0.0]
        mon = TrafficMonitor(lambda: t[0])
        for _ in range(100):
            mon.observe_request(M70, 1000, 100)  # the router's estimate: 100 output tokens
            t[0] += 0.1
        mon.observe_counters("w1", M70, 0, 0)
        t[0] += 1.0
        mon.observe_counters("w1", M70, processed_in, processed_out)
        return ModelDemand.from_stats(mon.stats(M70))

    # Outputs were estimated too short: the fleet produced 500 per request, that stands.
    d = demand(100_000, 50_000)
    assert d.arrival_rate_per_s == pytest.approx(100 / 11, rel=0.01)
    assert (d.mean_prompt_tokens, d.mean_output_tokens) == pytest.approx((1000, 500))
    # A fleet behind its backlog processed less than arrived: the requests' lengths stand
    # (found by the simulator: planning for what was processed hid the overload).
    d = demand(1_000, 500)
    assert (d.mean_prompt_tokens, d.mean_output_tokens) == pytest.approx((1000, 100))


def test_unsatisfiable_minimum_workers_fail_naming_the_field() -> None:
    from fleetshift_common.errors import FailedPrecondition

    nodes = [NodeCapacity("h100-0", H100_SXM, 2)]
    models = [ModelSpec(llama2_70b(), tp_options=(2,), min_workers=3)]
    inp = planning_input(nodes, models, [ModelDemand(M70, 1.0, 100, 100)])
    with pytest.raises(FailedPrecondition) as exc:
        Planner(PerfModel()).solve(inp)
    assert exc.value.field == "min_workers"


def test_a_solve_that_runs_out_of_time_before_any_placement_is_tried_again() -> None:
    """On a loaded host HiGHS can hit the 1 s limit before presolve ends: that is a slow
    host, not an impossible fleet, and must not read as FailedPrecondition on min_workers."""
    from fleetshift_common.errors import Unavailable

    inp = planning_input(
        h100_h200_fleet(),
        [ModelSpec(llama2_70b(), tp_options=(2, 4, 8))],
        [ModelDemand(M70, 5.0, 200, 1500)],
        default_slo=SLO,
    )
    unhurried = Planner(PerfModel()).solve(inp)
    starved = Planner(PerfModel(), PlannerConfig(time_limit_s=1e-9)).solve(inp)
    assert starved.placement == unhurried.placement
    assert starved.status == "optimal"

    never = PlannerConfig(time_limit_s=1e-9, retry_time_limit_s=1e-9)
    with pytest.raises(Unavailable, match=r"no placement within 1e-09 s.*host is too slow"):
        Planner(PerfModel(), never).solve(inp)


def test_a_node_limit_bounds_the_search_without_losing_the_placement() -> None:
    """The simulator's limit (nodes, not seconds): at one node HiGHS still returns the root's
    placement, and a limit below one is refused naming the field."""
    from fleetshift_common.errors import InvalidArgument

    inp = planning_input(
        h100_h200_fleet(),
        [ModelSpec(llama2_70b(), tp_options=(2, 4, 8))],
        [ModelDemand(M70, 5.0, 200, 1500)],
        default_slo=SLO,
    )
    one_node = Planner(PerfModel(), PlannerConfig(node_limit=1)).solve(inp)
    assert one_node.placement.workers
    assert (
        one_node.placement == Planner(PerfModel(), PlannerConfig(node_limit=1)).solve(inp).placement
    )
    with pytest.raises(InvalidArgument) as refused:
        PlannerConfig(node_limit=0)
    assert refused.value.field == "node_limit"


def test_worker_capacities_keep_the_slo_they_are_computed_for() -> None:
    planner = Planner(PerfModel())
    slo = SloTarget(ttft_ms=1500, tbt_ms=60)
    inp = planning_input(
        h100_h200_fleet(),
        [ModelSpec(llama2_70b())],
        [ModelDemand(M70, 10.0, 3000, 400)],
        default_slo=slo,
    )
    perf = PerfModel()
    opts = planner.options(inp)
    assert opts
    for o in opts:
        dep = Deployment(llama2_70b(), o.gpu, o.tp, o.key[4])
        # one prompt alone fits in the prefill share of the TTFT budget
        if o.prefill_tokens_per_s > 0:
            assert perf.prefill_time_s(dep, [3000]) <= slo.ttft_ms / 1e3
        # the decode batch the capacity assumes keeps the TBT SLO and fits in KV
        if o.decode_tokens_per_s > 0:
            b = o.decode_batch
            assert perf.decode_step_time_s(dep, b, b * 3200) <= slo.tbt_ms / 1e3
            assert b * 3400 <= perf.kv_capacity_tokens(dep)
