"""What a run delivered: SLO-judged goodput, latency percentiles, cost, utilisation, moves.

SLOs follow the Splitwise convention: a request is judged against its own *unloaded* times,
i.e. the same request alone on the fleet's reference deployment (by default the slowest GPU
kind of the fleet, so every kind can meet 1x). A request meets its SLO when it finished,
its TTFT <= ``ttft_multiple`` x unloaded TTFT and its mean time between tokens (TBT, i.e.
(E2E - TTFT) / (output - 1)) <= ``tbt_multiple`` x the unloaded decode step at its mean
context. Defaults: 6x and 5x. Dropped or unfinished requests count as misses.

Conservation is checked on every summary, not only in tests: every request either finished
or is counted dropped, and a finished request produced exactly the tokens it asked for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetshift_common.errors import FleetShiftError
from fleetshift_daemon.sim.engine import Simulator
from fleetshift_daemon.sim.timing import StepTimer
from fleetshift_daemon.sim.trace import FloatArray

PERCENTILES = (50, 90, 99)


class ConservationError(FleetShiftError):
    """The simulator lost or invented a request or a token: a bug, never a result."""


@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    finished: int
    dropped: int
    slo_met: int
    goodput_rps: float
    slo_attainment: float
    throughput_tok_s: float
    ttft_s: dict[int, float]
    tbt_s: dict[int, float]
    e2e_s: dict[int, float]
    max_gap_s: dict[int, float]
    ttft_slowdown_p99: float  # p99 of TTFT / unloaded TTFT (Splitwise's SLO is <= 6)
    tbt_slowdown_p99: float  # p99 of TBT / unloaded TBT (Splitwise's SLO is <= 5)
    makespan_s: float
    cost_per_mtok: float
    cost_per_good_mtok: float
    utilisation: dict[str, float]
    moves: dict[str, int]
    move_count: int
    sim_wall_s: float = 0.0
    events: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def meets_p99_slo(self, ttft_multiple: float = 6.0, tbt_multiple: float = 5.0) -> bool:
        return self.ttft_slowdown_p99 <= ttft_multiple and self.tbt_slowdown_p99 <= tbt_multiple

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("ttft_s", "tbt_s", "e2e_s", "max_gap_s"):
            d[k] = {f"p{p}": v for p, v in d[k].items()}
        return d


@dataclass(frozen=True)
class RequestOutcome:
    ttft_s: FloatArray
    tbt_s: FloatArray
    e2e_s: FloatArray
    slo_ok: np.ndarray
    finished: np.ndarray
    ttft_slowdown: FloatArray
    tbt_slowdown: FloatArray


def unloaded_times(sim: Simulator) -> tuple[FloatArray, FloatArray]:
    """Per request: TTFT and mean TBT alone on the reference deployment."""
    dep = sim.fleet.reference_deployment(sim.model)
    timer = sim.timers.get(dep) or StepTimer(sim.model, dep)
    p = sim.prompt
    o = sim.output
    up, inv = np.unique(p, return_inverse=True)
    ttft = np.array([timer.prefill_s([int(x)]) for x in up])[inv]
    ctx = p + o // 2
    uc, inv_c = np.unique(ctx, return_inverse=True)
    tbt = np.array([timer.decode_step_s(1, int(x)) for x in uc])[inv_c]
    return ttft, tbt


def outcomes(sim: Simulator) -> RequestOutcome:
    log = sim.log
    arrival = sim.trace.arrival_s
    finished = ~log.dropped & ~np.isnan(log.finish_s)
    ttft = log.first_token_s - arrival
    e2e = log.finish_s - arrival
    steps = np.maximum(sim.output - 1, 1)
    tbt = np.where(sim.output > 1, (log.finish_s - log.first_token_s) / steps, 0.0)
    u_ttft, u_tbt = unloaded_times(sim)
    slo = sim.fleet.slo
    ok = (
        finished
        & (ttft <= slo.ttft_multiple * u_ttft)
        & ((sim.output == 1) | (tbt <= slo.tbt_multiple * u_tbt))
    )
    return RequestOutcome(ttft, tbt, e2e, ok, finished, ttft / u_ttft, tbt / u_tbt)


def check_conservation(sim: Simulator) -> None:
    log = sim.log
    finished = ~np.isnan(log.finish_s)
    if np.any(finished & log.dropped):
        raise ConservationError("a request is both finished and dropped")
    if np.any(~finished & ~log.dropped):
        raise ConservationError("a request neither finished nor was dropped")
    bad = finished & (log.tokens_out != sim.output)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ConservationError(
            f"request {i} finished with {log.tokens_out[i]} tokens, asked {sim.output[i]}"
        )
    for inst in sim.instances:
        if not log.dropped.any() and (inst.kv_used or inst.batch or inst.waiting):
            raise ConservationError(f"instance {inst.idx} still holds work after the run")


def _pct(values: FloatArray) -> dict[int, float]:
    v = values[~np.isnan(values)]
    if not len(v):
        return {p: float("nan") for p in PERCENTILES}
    return {p: float(np.percentile(v, p)) for p in PERCENTILES}


def _p99_slowdown(values: FloatArray, finished: np.ndarray, counted: np.ndarray) -> float:
    """Over the ``counted`` requests; an unfinished one counts as infinitely slow."""
    v = np.where(finished, values, np.inf)[counted]
    return float(np.percentile(v, 99, method="higher")) if len(v) else float("nan")


def billed_dollars(sim: Simulator) -> float:
    """GPU-hours of instances in service (a retired, drained instance stops billing)."""
    price = {k.name: k.price_per_hour for k in sim.fleet.gpu_kinds()}
    return sum(i.billed_s * i.group.tp * price[i.gpu] for i in sim.instances) / 3600.0


def summarize(sim: Simulator, name: str, wall_s: float = 0.0) -> Summary:
    check_conservation(sim)
    out = outcomes(sim)
    log = sim.log
    n = len(sim.trace)
    duration = max(sim.trace.duration_s, 1e-9)
    fin = out.finished
    makespan = float(np.nanmax(log.finish_s)) if fin.any() else duration
    makespan = max(makespan, duration)
    tokens = float((sim.prompt[fin] + sim.output[fin]).sum())
    good_tokens = float((sim.prompt[out.slo_ok] + sim.output[out.slo_ok]).sum())
    dollars = billed_dollars(sim)
    util: dict[str, float] = {}
    for kind in {i.gpu for i in sim.instances}:
        insts = [i for i in sim.instances if i.gpu == kind]
        util[kind] = sum(i.busy_s for i in insts) / (len(insts) * makespan)
    moves = Counter(f"{m.kind}:{m.gpu}:{m.before}->{m.after}" for m in sim.moves)
    return Summary(
        policy=name,
        requests=n,
        finished=int(fin.sum()),
        dropped=int(log.dropped.sum()),
        slo_met=int(out.slo_ok.sum()),
        goodput_rps=float(out.slo_ok.sum()) / duration,
        slo_attainment=float(out.slo_ok.mean()) if n else 0.0,
        throughput_tok_s=float(sim.output[fin].sum()) / makespan,
        ttft_s=_pct(np.where(fin, out.ttft_s, np.nan)),
        tbt_s=_pct(np.where(fin & (sim.output > 1), out.tbt_s, np.nan)),
        e2e_s=_pct(np.where(fin, out.e2e_s, np.nan)),
        max_gap_s=_pct(np.where(fin & (sim.output > 1), log.max_gap_s, np.nan)),
        ttft_slowdown_p99=_p99_slowdown(out.ttft_slowdown, fin, np.ones(n, bool)),
        tbt_slowdown_p99=_p99_slowdown(out.tbt_slowdown, fin, sim.output > 1),
        makespan_s=makespan,
        cost_per_mtok=dollars / (tokens / 1e6) if tokens else float("inf"),
        cost_per_good_mtok=dollars / (good_tokens / 1e6) if good_tokens else float("inf"),
        utilisation=dict(sorted(util.items())),
        moves=dict(sorted(moves.items())),
        move_count=len(sim.moves),
        sim_wall_s=wall_s,
        events=sim.events,
        extra={
            "instances": instance_table(sim, makespan),
            "kv_transfer_share_of_e2e": _kv_share(sim, out),
            "kv_handoffs": int((log.kv_transfer_s > 0).sum()),
        },
    )


def _kv_share(sim: Simulator, out: RequestOutcome) -> float:
    """Summed KV transfer time over summed E2E of the finished requests that were handed off
    (Splitwise reports ~0.8 %)."""
    moved = out.finished & (sim.log.kv_transfer_s > 0)
    if not moved.any():
        return 0.0
    return float(sim.log.kv_transfer_s[moved].sum() / out.e2e_s[moved].sum())


def instance_table(sim: Simulator, makespan: float) -> list[dict[str, Any]]:
    """Per instance: its final role, how busy it was and how much work it took."""
    pre = np.bincount(sim.log.prefill_inst[sim.log.prefill_inst >= 0], minlength=len(sim.instances))
    dec = np.bincount(sim.log.decode_inst[sim.log.decode_inst >= 0], minlength=len(sim.instances))
    return [
        {
            "instance": i.idx,
            "node": i.node,
            "gpu": i.gpu,
            "tp": i.dep.tp,
            "final_role": i.role.value,
            "busy": i.busy_s / makespan,
            "billed_s": i.billed_s,
            "prefills": int(pre[i.idx]),
            "decodes": int(dec[i.idx]),
        }
        for i in sim.instances
    ]


def goodput_series(sim: Simulator, bucket_s: float) -> tuple[FloatArray, FloatArray]:
    """(bucket start, SLO-met requests per second finishing in that bucket)."""
    out = outcomes(sim)
    end = max(sim.trace.duration_s, float(np.nanmax(sim.log.finish_s, initial=0.0)))
    edges = np.arange(0.0, end + bucket_s, bucket_s)
    counts, _ = np.histogram(sim.log.finish_s[out.slo_ok], bins=edges)
    return edges[:-1], counts / bucket_s
