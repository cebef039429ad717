"""Capacity planning's semantics on short synthetic traces: rate scaling, the P99 criterion,
and Splitwise's mixed-pool scheduling of a split design.

Everything runs the real simulator timed by the daemon's performance model; the bench runs as
a user runs it (a real process reading a CSV the test writes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetshift_daemon.sim.capacity import Setting, Trier
from fleetshift_daemon.sim.engine import Simulator
from fleetshift_daemon.sim.fleet import SloRule
from fleetshift_daemon.sim.metrics import summarize
from fleetshift_daemon.sim.mixed_pool import MixedPoolSplit
from fleetshift_daemon.sim.policies import FixedSplit, LeastLoaded
from fleetshift_daemon.sim.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = ROOT / "bench" / "sim_capacity.py"
A, H = "A100-SXM-80GB", "H100-SXM"
PRICES = {A: 2.21, H: 4.76}


def trace_of(rows: list[tuple[float, int, int]]) -> Trace:
    rows = sorted(rows)
    return Trace(
        np.array([r[0] for r in rows]),
        np.array([r[1] for r in rows], dtype=np.int64),
        np.array([r[2] for r in rows], dtype=np.int64),
    )


def write_csv(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:00:{t:09.6f},{p},{o}" for t, p, o in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def capacity_run(tmp_path: Path, csv: Path, scaling: str) -> dict[float, dict[str, float]]:
    """The bench at x1 and x2 on one H100 design; per rate what it replayed."""
    out = tmp_path / f"{scaling}.json"
    run = subprocess.run(
        [sys.executable, str(CAPACITY), "--trace", str(csv), "--minutes", "0",
         "--rates", "1,2", "--scaling", scaling, "--kinds", H, "--prices", f"{H}=4.76",
         "--splits", "none", "--dynamic", "none", "--slo-reference", H, "--jobs", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["meta"]["scaling"] == scaling
    return {s["rate"]: s for s in doc["searches"]}


def test_time_compression_replays_the_same_requests_faster_and_copies_replay_more(
    tmp_path: Path,
) -> None:
    # a quiet minute (one request every 2 s) with a burst of 20 requests in its middle second
    rows = [(2.0 * i, 200, 20) for i in range(30)] + [(30.0 + i / 20, 200, 20) for i in range(20)]
    csv = write_csv(tmp_path / "burst.csv", rows)
    span = max(t for t, _, _ in rows) - min(t for t, _, _ in rows)

    fast = capacity_run(tmp_path, csv, "time-compress")
    assert fast[1.0]["requests"] == fast[2.0]["requests"] == 50  # the same requests ...
    assert fast[1.0]["duration_s"] == pytest.approx(span)
    assert fast[2.0]["duration_s"] == pytest.approx(span / 2)  # ... arriving twice as fast

    copies = capacity_run(tmp_path, csv, "copies")
    assert copies[2.0]["requests"] == 2 * copies[1.0]["requests"] == 100  # every request twice
    assert copies[2.0]["duration_s"] == pytest.approx(span, abs=1.0)  # over the same hour


def pairs_then_quiet(slow: int) -> Trace:
    """200 requests, 5 s apart on an idle machine, of which ``slow`` short ones arrive 1 ms
    after a long prompt and wait for its prefill (TTFT ~15x their unloaded TTFT)."""
    rows: list[tuple[float, int, int]] = []
    t = 0.0
    for _ in range(slow):
        rows += [(t, 8000, 2), (t + 0.001, 100, 8)]
        t += 5.0
    while len(rows) < 200:
        rows.append((t, 100, 8))
        t += 5.0
    return trace_of(rows)


def test_the_p99_criterion_forgives_one_slow_request_in_two_hundred_but_not_two() -> None:
    setting = Setting("llama2-70b", PRICES, SloRule(6.0, 5.0, H))
    trials = [Trier(pairs_then_quiet(k), setting).run([(H, 1)], LeastLoaded()) for k in (0, 1, 2)]
    none, one, two = trials
    assert none.passed and none.ttft_p99 < 2.0
    assert one.passed and one.ttft_p99 < 2.0  # the one slow request sits above the p99
    assert not two.passed and two.ttft_p99 > 6.0  # two of 200 do not: the fleet fails
    assert all(t.tbt_p99 < 5.0 for t in trials)  # TTFT alone decided it
    assert one.cost_per_h == pytest.approx(4.76)  # priced per machine-hour as given


def long_sequences(n: int, every_s: float) -> Trace:
    """Requests whose KV (6,000 tokens each) fills a token machine after ~240 of them."""
    return trace_of([(i * every_s, 4000, 2000) for i in range(n)])


def split_run(trace: Trace, counts: list[tuple[str, int]], policy: FixedSplit) -> Simulator:
    setting = Setting("llama2-70b", PRICES, SloRule(6.0, 5.0, A))
    sim = Simulator(setting.fleet(counts), trace, policy)
    sim.run()
    return sim


def test_a_full_token_machine_borrows_prompt_machines_to_decode_under_the_mixed_pool() -> None:
    trace = long_sequences(400, 0.15)
    design = [(H, 2), (A, 1)]  # Splitwise-HA 2H+1A: instances 0, 1 prompt, 2 token
    rigid = split_run(trace, design, FixedSplit(prefill=2))
    mixed = split_run(trace, design, MixedPoolSplit(prefill=2))
    assert set(rigid.log.decode_inst.tolist()) == {2}  # fixed pools: only the token machine
    on_prompt = np.isin(mixed.log.decode_inst, [0, 1])
    assert on_prompt.sum() > 50  # the mixed pool decodes the overflow on prompt machines
    assert mixed.log.kv_transfer_s[on_prompt].max() == 0.0  # where its KV already is
    fast, slow = summarize(mixed, "mixed"), summarize(rigid, "rigid")
    assert fast.tbt_slowdown_p99 < slow.tbt_slowdown_p99
    assert fast.e2e_s[99] < slow.e2e_s[99]


def test_a_long_prompt_queue_lends_a_token_machine_to_prefill_under_the_mixed_pool() -> None:
    burst = trace_of([(0.001 * i, 4000, 50) for i in range(40)])  # 160k prompt tokens at once
    design = [(H, 1), (A, 1)]
    rigid = split_run(burst, design, FixedSplit(prefill=1))
    mixed = split_run(burst, design, MixedPoolSplit(prefill=1))
    assert set(rigid.log.prefill_inst.tolist()) == {0}
    lent = mixed.log.prefill_inst == 1
    assert lent.sum() >= 10  # the token machine took part of the burst's prompts ...
    assert np.all(mixed.log.decode_inst[lent] == 1)  # ... and served them colocated
    assert (~lent).sum() >= 10  # once both queues are long, the shorter queue takes the next
    assert rigid.log.kv_transfer_s.min() > 0.0 and mixed.log.kv_transfer_s[lent].max() == 0.0
