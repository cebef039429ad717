"""The baseline placement and routing policies the simulator compares FleetShift against.

All of them see the same instances; they differ only in the roles they give instances and
where they send each request:

* ``RoundRobin``: every instance colocated (prefill and decode), requests dealt in turn.
* ``LeastLoaded``: colocated, join-the-shortest-queue by pending tokens.
* ``StaticSplit``: Splitwise-style prefill and decode pools fixed at deploy time. The pools
  are chosen with the performance model: instances are ranked by how much faster they
  prefill than they decode (relative to the fleet), and the prefill pool grows in that order
  until it balances the decode pool for the mix seen in the first window of the trace.
* ``FixedSplit``: pools fixed by a fleet design instead (Splitwise-HA / -HH: so many prompt
  machines of one kind, so many token machines of another): the first ``prefill`` instances
  in fleet order prefill, the rest decode; routing as ``StaticSplit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.sim.engine import Instance, Role, Simulator
from fleetshift_daemon.sim.timing import StepTimer

DEPLOY_WINDOW_S = 300.0


@dataclass(frozen=True)
class Mix:
    """What the traffic looks like over a window: rate and mean shape."""

    rate_per_s: float
    mean_prompt: float
    mean_output: float


def observed_mix(sim: Simulator, start_s: float, end_s: float) -> Mix:
    w = sim.trace.window(start_s, end_s)
    span = max(end_s - start_s, 1e-9)
    if not len(w):
        return Mix(0.0, 1.0, 1.0)
    return Mix(len(w) / span, float(w.prompt_tokens.mean()), float(w.output_tokens.mean()))


def prefill_rate(timer: StepTimer, mean_prompt: float, budget: int) -> float:
    """Prompt tokens per second one instance sustains on prompts of the mean length."""
    p = max(1, round(mean_prompt))
    n = max(1, budget // p)
    return n * p / timer.prefill_s([p] * n)


def decode_rate(timer: StepTimer, kv_cap: int, mix: Mix, max_batch: int) -> float:
    """Tokens per second one instance decodes with the largest batch its KV admits."""
    seq = mix.mean_prompt + mix.mean_output
    b = int(max(1, min(max_batch, kv_cap // max(seq, 1.0))))
    ctx = int(b * (mix.mean_prompt + mix.mean_output / 2))
    return b / timer.decode_step_s(b, ctx)


def fits(sim: Simulator, inst: Instance, req: int) -> bool:
    return int(sim.prompt[req] + sim.output[req]) <= inst.kv_cap


class RoundRobin:
    name = "rr"
    tick_s: float | None = None

    def __init__(self) -> None:
        self._next = 0

    def setup(self, sim: Simulator) -> None:
        for inst in sim.instances:
            inst.role = Role.MIXED

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        n = len(sim.instances)
        for _ in range(n):
            inst = sim.instances[self._next % n]
            self._next += 1
            if fits(sim, inst, req):
                return inst
        return None

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance:
        return src

    def on_tick(self, sim: Simulator, t: float) -> None:
        return None


class LeastLoaded(RoundRobin):
    name = "ll"

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        best = None
        best_load = 0
        for inst in sim.instances:
            if not fits(sim, inst, req):
                continue
            load = inst.pending_tokens(t)
            if best is None or load < best_load:
                best, best_load = inst, load
        return best


def least_busy(
    sim: Simulator, pool: Sequence[Instance], req: int, t: float, rates: dict[int, float]
) -> Instance | None:
    """The instance of ``pool`` that would clear its pending tokens first."""
    best = None
    best_s = 0.0
    for inst in pool:
        if not fits(sim, inst, req):
            continue
        s = inst.pending_tokens(t) / rates[inst.idx]
        if best is None or s < best_s:
            best, best_s = inst, s
    return best


def balanced_split(sim: Simulator, mix: Mix) -> list[Role]:
    """Roles per instance: the prefill pool that best balances the two pools for ``mix``."""
    cfg = sim.config
    pre = np.array(
        [prefill_rate(i.timer, mix.mean_prompt, cfg.prefill_token_budget) for i in sim.instances]
    )
    dec = np.array([decode_rate(i.timer, i.kv_cap, mix, cfg.max_batch) for i in sim.instances])
    order = np.argsort(-(pre / pre.mean()) / (dec / dec.mean()), kind="stable")
    best_n, best_load = 1, np.inf
    for n in range(1, len(order)):
        p_load = mix.mean_prompt / pre[order[:n]].sum()
        d_load = mix.mean_output / dec[order[n:]].sum()
        load = max(p_load, d_load)
        if load < best_load:
            best_n, best_load = n, load
    roles = [Role.DECODE] * len(sim.instances)
    for i in order[:best_n]:
        roles[int(i)] = Role.PREFILL
    return roles


class StaticSplit:
    name = "split"
    tick_s: float | None = None

    def __init__(self, deploy_window_s: float = DEPLOY_WINDOW_S) -> None:
        self.deploy_window_s = deploy_window_s
        self.prefill_rates: dict[int, float] = {}
        self.decode_rates: dict[int, float] = {}

    def setup(self, sim: Simulator) -> None:
        mix = observed_mix(sim, 0.0, self.deploy_window_s)
        for inst, role in zip(sim.instances, balanced_split(sim, mix), strict=True):
            inst.role = role
        self.rates(sim, mix)

    def rates(self, sim: Simulator, mix: Mix) -> None:
        cfg = sim.config
        for i in sim.instances:
            self.prefill_rates[i.idx] = prefill_rate(
                i.timer, mix.mean_prompt, cfg.prefill_token_budget
            )
            self.decode_rates[i.idx] = decode_rate(i.timer, i.kv_cap, mix, cfg.max_batch)

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        pool = [i for i in sim.instances if i.role in (Role.MIXED, Role.PREFILL)]
        return least_busy(sim, pool or sim.instances, req, t, self.prefill_rates)

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance:
        pool = [i for i in sim.instances if i.role is Role.DECODE]
        return least_busy(sim, pool, req, t, self.decode_rates) or src

    def on_tick(self, sim: Simulator, t: float) -> None:
        return None


class FixedSplit(StaticSplit):
    """Splitwise's designed fleets: the pool sizes are the design, not chosen from traffic."""

    name = "fixed-split"

    def __init__(self, prefill: int, deploy_window_s: float = DEPLOY_WINDOW_S) -> None:
        super().__init__(deploy_window_s)
        self.prefill = prefill

    def setup(self, sim: Simulator) -> None:
        if not 0 < self.prefill < len(sim.instances):
            raise InvalidArgument(
                f"a split needs 1..{len(sim.instances) - 1} prefill instances of "
                f"{len(sim.instances)}, got {self.prefill}",
                field="prefill",
            )
        for inst in sim.instances:
            inst.role = Role.PREFILL if inst.idx < self.prefill else Role.DECODE
        self.rates(sim, observed_mix(sim, 0.0, self.deploy_window_s))
