"""Issue 11's placement properties on short traces: bursts, measured margin, mix shifts.

Each test replays traffic an operator would recognise (a burst after a quiet spell, a load
that drops, a mix that flips) through the daemon's own planning cycle in the simulator and
asserts what the operator would see: requests meeting their SLO, workers started before the
next burst, retirements only after measured margin held, roles that follow the mix.
"""

from __future__ import annotations

import numpy as np

from fleetshift_daemon.core.burst import BurstConfig
from fleetshift_daemon.core.perfmodel import Dtype, llama2_70b
from fleetshift_daemon.core.planner import PlannerConfig
from fleetshift_daemon.core.slo_monitor import SloMonitorConfig
from fleetshift_daemon.sim.engine import Role, Simulator
from fleetshift_daemon.sim.fleet import NodeGroup, SimFleet
from fleetshift_daemon.sim.fleetshift import FleetShift
from fleetshift_daemon.sim.metrics import outcomes, summarize
from fleetshift_daemon.sim.policies import LeastLoaded
from fleetshift_daemon.sim.trace import Trace, synthetic_trace

FLEET = SimFleet(
    llama2_70b(),
    Dtype.BF16,
    (NodeGroup("H100-SXM", 3, 8, 8), NodeGroup("H200-SXM", 3, 8, 8)),
)


def _concat(*parts: tuple[Trace, float]) -> Trace:
    return Trace(
        np.concatenate([t.arrival_s + at for t, at in parts]),
        np.concatenate([t.prompt_tokens for t, _ in parts]),
        np.concatenate([t.output_tokens for t, _ in parts]),
    )


def _serving(sim: Simulator, t: float) -> int:
    """Instances in service (not off, not still loading) at time ``t``, from the move log."""
    roles = {i.idx: Role.MIXED for i in sim.instances}
    ready = {i.idx: 0.0 for i in sim.instances}
    initial = {m.instance: Role(m.before) for m in reversed(sim.moves)}
    for idx, before in initial.items():
        roles[idx] = before
    for inst in sim.instances:
        if inst.idx not in initial:
            roles[inst.idx] = inst.role
    for m in sim.moves:
        if m.time_s <= t:
            roles[m.instance] = Role(m.after)
            ready[m.instance] = m.time_s + m.cost_s
    return sum(1 for i, r in roles.items() if r is not Role.OFF and ready[i] <= t)


def test_a_burst_after_a_quiet_spell_finds_the_capacity_the_last_burst_needed() -> None:
    # Quiet (1 req/s), a 6x burst for 40 s, ten quiet minutes, the same burst again. The
    # first burst teaches the fleet its size; the quiet spell must not retire what the second
    # one needs, which a start (two minutes of weight loading) could not bring back in time.
    quiet = synthetic_trace(300, 1.0, prompt_tokens=1500, output_tokens=150, seed=1)
    burst = synthetic_trace(240, 6.0, prompt_tokens=1500, output_tokens=150, seed=2)
    calm = synthetic_trace(600, 1.0, prompt_tokens=1500, output_tokens=150, seed=3)
    trace = _concat((quiet, 0.0), (burst, 330.0), (calm, 380.0), (burst, 1000.0), (quiet, 1050))
    fs = Simulator(FLEET, trace, FleetShift()).run()
    ll = Simulator(FLEET, trace, LeastLoaded()).run()
    second = (trace.arrival_s >= 1000.0) & (trace.arrival_s < 1045.0)
    ok_fs, ok_ll = outcomes(fs).slo_ok, outcomes(ll).slo_ok
    # the bar: never more than a point below least-loaded over the whole fleet
    assert ok_fs[second].mean() >= ok_ll[second].mean() - 0.01, "the second burst broke the SLO"
    assert _serving(fs, 999.0) > _serving(fs, 320.0), "capacity was not back before the burst"
    s_fs, s_ll = summarize(fs, "fleetshift"), summarize(ll, "ll")
    assert s_fs.cost_per_mtok < s_ll.cost_per_mtok  # it still switched off what no burst needs


def test_retirements_wait_for_sustained_measured_margin_then_happen() -> None:
    # Heavy traffic, then a tenth of it: the planner soon wants fewer workers, but none may
    # retire before measured attainment has kept its margin for retire_hold_s; once it has,
    # the surplus retires (a saving never opens the efficiency gap, so nothing else would).
    heavy = synthetic_trace(2000, 10.0, prompt_tokens=800, output_tokens=300, seed=4)
    light = synthetic_trace(1500, 1.0, prompt_tokens=800, output_tokens=300, seed=5)
    trace = _concat((heavy, 0.0), (light, 200.5))
    hold = 600.0
    policy = FleetShift(
        slo_monitor=SloMonitorConfig(retire_hold_s=hold),
        burst=BurstConfig(memory_s=120.0),  # the heavy spell is not a burst to keep for
    )
    sim = Simulator(FLEET, trace, policy).run()
    retired = [m for m in sim.moves if m.after == Role.OFF.value]
    assert retired, "the load fell tenfold; the surplus must retire"
    first_report = policy.tick_s  # the first heartbeat: no margin can be older
    assert min(m.time_s for m in retired) >= first_report + hold
    assert summarize(sim, "fleetshift").slo_attainment >= 0.99
    in_service_at_end = sum(1 for i in sim.instances if i.role is not Role.OFF)
    assert in_service_at_end <= 2


def test_an_owned_fleet_follows_a_mix_shift_with_role_changes_within_minutes() -> None:
    # Prompt-heavy for ten minutes, then decode-heavy: every instance stays on (an owned
    # fleet), so only roles can follow the mix, and they must.
    prompt_heavy = synthetic_trace(3000, 5.0, prompt_tokens=3000, output_tokens=40, seed=6)
    decode_heavy = synthetic_trace(3000, 5.0, prompt_tokens=150, output_tokens=700, seed=7)
    shift_at = prompt_heavy.duration_s + 0.2
    trace = _concat((prompt_heavy, 0.0), (decode_heavy, shift_at))
    sim = Simulator(FLEET, trace, FleetShift(keep_all=True)).run()
    changes = [m for m in sim.moves if m.kind == "role_change" and m.after != m.before]
    after = [m for m in changes if m.time_s > shift_at]
    assert after, "the mix flipped and no role followed it"
    assert min(m.time_s for m in after) <= shift_at + 300.0
    assert any(m.after == Role.DECODE.value or m.after == Role.MIXED.value for m in after)
    assert all(m.after != Role.OFF.value for m in sim.moves)  # an owned fleet keeps them all


def _on_off(base_rps: float, peak_rps: float, burst_s: float, period_s: float, n: int) -> Trace:
    """Poisson at ``base_rps`` with a ``burst_s`` burst at ``peak_rps`` ending each period."""
    parts = []
    for k in range(n):
        calm = synthetic_trace(int(base_rps * (period_s - burst_s)), base_rps, 1500, 150, 10 + k)
        burst = synthetic_trace(int(peak_rps * burst_s), peak_rps, 1500, 150, seed=50 + k)
        parts += [(calm, k * period_s), (burst, (k + 1) * period_s - burst_s)]
    trace = _concat(*parts)
    order = np.argsort(trace.arrival_s, kind="stable")
    return Trace(trace.arrival_s[order], trace.prompt_tokens[order], trace.output_tokens[order])


def test_bursts_past_the_whole_fleet_keep_it_colocated_and_level_with_least_loaded() -> None:
    # 20x bursts that no placement of the fleet can carry. Before issue 11's fix the planner
    # served as much of the burst-sized demand as it could with a split skewed to prefill
    # (its prefill factor far above decode's), which could not even serve the mean mix, and
    # met 37 % of SLOs against least-loaded's 46 %. Now the factors are fitted to what the
    # fleet can carry and its workers colocate, so every instance takes the prompt bursts.
    trace = _on_off(3.0, 60.0, 5.0, 60.0, 4)
    ll = summarize(Simulator(FLEET, trace, LeastLoaded()).run(), "ll")
    sim = Simulator(FLEET, trace, FleetShift()).run()
    fs = summarize(sim, "fleetshift")
    assert ll.slo_attainment < 0.9, "the bursts must overload the fleet for this test to mean much"
    assert fs.slo_attainment >= ll.slo_attainment - 0.01
    assert all(i.role is Role.MIXED for i in sim.instances)


def test_an_owned_fleet_turns_its_roles_within_minutes_of_a_shift_and_keeps_the_slo() -> None:
    # The same prompt-heavy then decode-heavy day as above. The planner used to size for the
    # five-minute blend until the old requests left its window: the first role change came
    # 144 s after the shift and 94 % of the decode-heavy requests met their SLO. Judged on
    # the last minute's request lengths once they differ from the window's beyond noise, the
    # roles turn within minutes and the SLO holds: 84 s on the performance model this was
    # written on, 124 s on the refitted one (issue 12), with every later request in its SLO.
    prompt_heavy = synthetic_trace(3000, 5.0, prompt_tokens=3000, output_tokens=40, seed=6)
    decode_heavy = synthetic_trace(3000, 5.0, prompt_tokens=150, output_tokens=700, seed=7)
    shift_at = prompt_heavy.duration_s + 0.2
    trace = _concat((prompt_heavy, 0.0), (decode_heavy, shift_at))
    sim = Simulator(FLEET, trace, FleetShift(keep_all=True)).run()
    turned = [
        m.time_s
        for m in sim.moves
        if m.kind == "role_change" and m.after != m.before and m.time_s > shift_at
    ]
    assert turned and min(turned) <= shift_at + 150.0
    after = trace.arrival_s >= shift_at
    assert outcomes(sim).slo_ok[after].mean() >= 0.99


def test_a_replay_decides_the_same_however_slow_the_host_is() -> None:
    # The daemon's planner stops HiGHS after 1 s of wall clock; a replay that did the same
    # would decide differently on a loaded host (one crashed that way at load 30). A planner
    # given no wall-clock time at all must make the simulator decide exactly as it does
    # unhurried: the simulator bounds the solve by branch-and-bound nodes instead.
    # 240 s of each mix: long enough that the planner changes roles (with 120 s of each it
    # made no move at mixed_efficiency 0.925, which would leave nothing to compare).
    prompt_heavy = synthetic_trace(1200, 5.0, prompt_tokens=3000, output_tokens=40, seed=6)
    decode_heavy = synthetic_trace(1200, 5.0, prompt_tokens=150, output_tokens=700, seed=7)
    trace = _concat((prompt_heavy, 0.0), (decode_heavy, prompt_heavy.duration_s + 0.2))
    starved = PlannerConfig(time_limit_s=1e-9, retry_time_limit_s=1e-9)
    runs = [
        Simulator(FLEET, trace, FleetShift(keep_all=True, planner_config=config)).run()
        for config in (None, starved)
    ]
    unhurried, hurried = ([(m.time_s, m.instance, m.after) for m in s.moves] for s in runs)
    assert unhurried and hurried == unhurried
    assert summarize(runs[1], "fs") == summarize(runs[0], "fs")
