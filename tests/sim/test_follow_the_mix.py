"""An owned fleet follows a service shift (issue 11, round 4), on tuning minutes only.

The traffic is the real thing an operator replays: the Azure conversation service, then the
Mooncake long-context chatbot, both from the first 30 minutes of their traces (the tuning
half; the later halves are the held-out columns of ``docs/bench-sim.md``).
"""

from __future__ import annotations

from pathlib import Path

from fleetshift_daemon.sim.fleet import standard_fleet
from fleetshift_daemon.sim.metrics import outcomes
from fleetshift_daemon.sim.runner import RunOptions, run_policies
from fleetshift_daemon.sim.synthetic import service_shift
from fleetshift_daemon.sim.trace import load_trace

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
AZURE = SHARED / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "mooncake_conversation_trace.jsonl"


def test_an_owned_fleet_serves_more_than_split_and_least_loaded_after_a_shift() -> None:
    # Azure minutes 0-10, then Mooncake minutes 10-20 (tuning data), twice as fast. Split's
    # pools were sized on the conversation minutes and colocated least-loaded cannot give the
    # long prompts a prefill pool. Before round 4 the owned fleet deployed whichever carrying
    # placement the solver met first and judged its roles against a reference that moved by
    # solver noise: 2.53 requests/s within SLO after the shift against least-loaded's 2.43
    # (1.04x) and split's 1.02. Now 3.26 (1.34x the better of the two).
    span = 1200.0
    azure = load_trace(AZURE).window(0.0, span)
    mooncake = load_trace(MOONCAKE).window(0.0, span)
    trace = service_shift(azure, mooncake, span / 2).window(0.0, span).time_compressed(2.0)
    switch = span / 2 / 2.0
    runs = run_policies(
        standard_fleet(preset="llama31-70b"),
        trace,
        ("ll", "split", "fleetshift-all"),
        RunOptions(),
    )
    after = trace.arrival_s >= switch
    served = {
        r.name: float(outcomes(r.sim).slo_ok[after].sum()) / (trace.duration_s - switch)
        for r in runs
    }
    assert served["fleetshift-all"] >= 1.2 * max(served["ll"], served["split"]), served
    owned = next(r for r in runs if r.name == "fleetshift-all")
    assert any(m.kind == "role_change" and m.time_s > switch for m in owned.sim.moves)
