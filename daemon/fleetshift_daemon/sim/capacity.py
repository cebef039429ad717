"""Capacity planning, Splitwise-style: the cheapest fleet of machines that meets the P99 SLO.

A *design* is what Splitwise compares: a homogeneous fleet of one machine kind running
colocated instances with least-loaded routing (``Baseline-A100``), or a split fleet of so many
prompt machines of one kind and so many token machines of another (``Splitwise-HA``: H100
prompt machines, A100 token machines), pools fixed at deploy time (``policies.FixedSplit``).
A *dynamic* policy (``fleetshift``, ``fleetshift-all``) is given a family of fleets (one kind,
or two kinds half and half) and placed by itself; ``fleetshift`` may switch machines off, so
what it costs is what it billed.

Every machine holds one instance of the whole machine (TP = GPUs per machine, 8 here). A fleet
passes when the p99 over requests of TTFT / unloaded TTFT is <= ``SloRule.ttft_multiple`` and
of TBT / unloaded TBT <= ``tbt_multiple``, unloaded times taken alone on the SLO's reference
kind (an idle DGX-A100 in Splitwise's comparison).

Searches assume monotonicity (a fleet with more machines of each pool does not do worse),
which is what makes them minutes rather than hours; each stops at a cost bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetshift_daemon.core.gpus import default_catalogue
from fleetshift_daemon.core.perfmodel import PRESETS, Deployment, Dtype, PerfModel
from fleetshift_daemon.sim.engine import Policy, SimConfig, Simulator
from fleetshift_daemon.sim.fleet import NodeGroup, SimFleet, SloRule
from fleetshift_daemon.sim.metrics import billed_dollars, summarize
from fleetshift_daemon.sim.policies import FixedSplit, LeastLoaded
from fleetshift_daemon.sim.runner import RunOptions, make_policy
from fleetshift_daemon.sim.timing import StepTimer
from fleetshift_daemon.sim.trace import Trace

GPUS_PER_MACHINE = 8
SHORT = {"A100-SXM-80GB": "A", "H100-SXM": "H", "H200-SXM": "H200"}
MAX_MACHINES = 40


@dataclass(frozen=True)
class Design:
    """A static fleet design: colocated on one kind, or prompt kind + token kind."""

    prefill_kind: str
    decode_kind: str | None = None  # None: a colocated baseline

    @property
    def name(self) -> str:
        if self.decode_kind is None:
            return f"Baseline-{self.prefill_kind.split('-')[0]}"
        return f"Splitwise-{short(self.prefill_kind)}{short(self.decode_kind)}"


def short(kind: str) -> str:
    return SHORT.get(kind, kind)


@dataclass(frozen=True)
class Setting:
    """What every fleet of one search shares: model, prices per machine-hour, SLO, config."""

    preset: str
    machine_price: Mapping[str, float]
    slo: SloRule
    config: SimConfig = field(default_factory=SimConfig)

    def fleet(self, counts: Sequence[tuple[str, int]]) -> SimFleet:
        """Groups in the given order (a split's prompt machines first), one instance each."""
        prices = {
            k: {"price_per_hour": p / GPUS_PER_MACHINE} for k, p in self.machine_price.items()
        }
        groups = tuple(
            NodeGroup(k, n, GPUS_PER_MACHINE, GPUS_PER_MACHINE) for k, n in counts if n > 0
        )
        return SimFleet(
            PRESETS[self.preset](),
            Dtype.BF16,
            groups,
            default_catalogue().extended(prices),
            self.slo,
        )

    def cost(self, counts: Sequence[tuple[str, int]]) -> float:
        return sum(self.machine_price[k] * n for k, n in counts)


@dataclass(frozen=True)
class Trial:
    """One fleet tried: its machines, whether it passed, its p99 slowdowns and bill."""

    counts: tuple[tuple[str, int], ...]
    passed: bool
    ttft_p99: float
    tbt_p99: float
    cost_per_h: float
    billed_per_h: float
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": [[k, n] for k, n in self.counts],  # in pool order: a split's prompt first
            "passed": self.passed,
            "ttft_slowdown_p99": self.ttft_p99,
            "tbt_slowdown_p99": self.tbt_p99,
            "usd_per_hour": self.cost_per_h,
            "billed_usd_per_hour": self.billed_per_h,
            "wall_s": self.wall_s,
        }


@dataclass
class Search:
    """A search's answer (None: nothing passed below the bound) and every fleet it tried."""

    label: str
    rate: float
    best: Trial | None = None
    trials: list[Trial] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "rate": self.rate,
            "best": self.best.as_dict() if self.best else None,
            "trials": [t.as_dict() for t in self.trials],
        }


class Trier:
    """Runs fleets on one trace, sharing step-time caches across the runs."""

    def __init__(self, trace: Trace, setting: Setting) -> None:
        self.trace = trace
        self.setting = setting
        self.model = PerfModel()
        self.timers: dict[Deployment, StepTimer] = {}

    def run(self, counts: Sequence[tuple[str, int]], policy: Policy) -> Trial:
        fleet = self.setting.fleet(counts)
        t0 = time.perf_counter()
        sim = Simulator(fleet, self.trace, policy, self.model, self.setting.config, self.timers)
        sim.run()
        s = summarize(sim, policy.name)
        hours = s.makespan_s / 3600.0
        passed = s.meets_p99_slo(self.setting.slo.ttft_multiple, self.setting.slo.tbt_multiple)
        return Trial(
            tuple((k, n) for k, n in counts if n > 0),
            passed,
            s.ttft_slowdown_p99,
            s.tbt_slowdown_p99,
            self.setting.cost(counts),
            billed_dollars(sim) / hours,
            time.perf_counter() - t0,
        )


SplitPolicy = Callable[[int], Policy]  # prompt-pool size -> the split's scheduling policy


def search_design(
    trier: Trier,
    design: Design,
    rate: float,
    log: Callable[[str], None],
    split: SplitPolicy = FixedSplit,
) -> Search:
    """The cheapest passing fleet of ``design`` (ties: fewer machines).

    ``split`` schedules a split design: ``FixedSplit`` (pools never lend) or Splitwise's own
    ``mixed_pool.MixedPoolSplit`` (an overloaded pool borrows machines of the other).
    """
    found = Search(design.name, rate)
    if design.decode_kind is None:
        for n in range(1, MAX_MACHINES + 1):
            trial = trier.run([(design.prefill_kind, n)], LeastLoaded())
            _note(found, trial, log)
            if trial.passed:
                found.best = trial
                return found
        return found
    return _search_split(trier, design, found, log, split)


def _search_split(
    trier: Trier,
    design: Design,
    found: Search,
    log: Callable[[str], None],
    split: SplitPolicy = FixedSplit,
) -> Search:
    """For each prompt-pool size, the smallest token pool that passes, under the cost bound.

    A token pool that already meets TBT while TTFT stays over and did not improve by a tenth
    with the last token machine is taken as prompt-bound: the next prompt-pool size is tried.
    So is one whose last ``FLAT_STEPS`` token machines improved neither p99 by a tenth (with
    Splitwise's mixed pool the token machines take prompts too, so TBT can stay over while
    the prompt pool is what limits).
    """
    pk, dk = design.prefill_kind, design.decode_kind
    assert dk is not None
    bound = math.inf
    for n_p in range(1, MAX_MACHINES):
        if trier.setting.cost([(pk, n_p), (dk, 1)]) >= bound:
            break
        last_ttft = math.inf
        seen: list[Trial] = []
        for n_d in range(1, MAX_MACHINES - n_p + 1):
            counts = [(pk, n_p), (dk, n_d)]
            if trier.setting.cost(counts) >= bound:
                break
            trial = trier.run(counts, split(n_p))
            _note(found, trial, log)
            if trial.passed:
                found.best, bound = trial, trial.cost_per_h
                break
            slo = trier.setting.slo
            if trial.tbt_p99 <= slo.tbt_multiple and trial.ttft_p99 > 0.9 * last_ttft:
                break
            last_ttft = trial.ttft_p99
            seen.append(trial)
            if _flat(seen):
                log(f"  {found.label}: {n_p} prompt machines, more token machines do not help")
                break
    return found


FLAT_STEPS = 3


def _flat(trials: Sequence[Trial]) -> bool:
    """The last ``FLAT_STEPS`` trials improved neither p99 slowdown by a tenth."""
    if len(trials) <= FLAT_STEPS:
        return False
    before = trials[-FLAT_STEPS - 1]
    recent = trials[-FLAT_STEPS:]
    return (
        min(t.ttft_p99 for t in recent) > 0.9 * before.ttft_p99
        and min(t.tbt_p99 for t in recent) > 0.9 * before.tbt_p99
    )


def family_counts(kinds: Sequence[str], n: int) -> list[tuple[str, int]]:
    """``n`` machines of one kind, or split over two kinds (the larger half on the second)."""
    if len(kinds) == 1:
        return [(kinds[0], n)]
    first, second = kinds
    return [(first, n // 2), (second, n - n // 2)]


def search_dynamic(
    trier: Trier, policy: str, kinds: Sequence[str], rate: float, log: Callable[[str], None]
) -> Search:
    """The smallest passing fleet of the family for a policy that places by itself.

    A policy that switches machines off (``fleetshift``) may leave added machines off; once
    three sizes in a row bill the same, more machines cannot help and the search stops.
    """
    found = Search(f"{policy} on {'+'.join(short(k) for k in kinds)}", rate)
    bills: list[float] = []
    for n in range(len(kinds), MAX_MACHINES + 1):
        trial = trier.run(family_counts(kinds, n), make_policy(policy, RunOptions()))
        _note(found, trial, log)
        if trial.passed:
            found.best = trial
            return found
        bills.append(trial.billed_per_h)
        if len(bills) >= 3 and max(bills[-3:]) <= min(bills[-3:]) * 1.02:
            log(f"  {found.label}: stops, the extra machines stay off")
            return found
    return found


def _note(found: Search, trial: Trial, log: Callable[[str], None]) -> None:
    found.trials.append(trial)
    fleet = "+".join(f"{n}{short(k)}" for k, n in trial.counts)
    log(
        f"  x{found.rate:g} {found.label:22s} {fleet:10s} p99 x{trial.ttft_p99:.1f}/"
        f"x{trial.tbt_p99:.1f} ${trial.cost_per_h:.2f}/h billed ${trial.billed_per_h:.2f}/h "
        f"{'ok' if trial.passed else '-'} ({trial.wall_s:.1f} s)"
    )
