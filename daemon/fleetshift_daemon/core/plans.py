"""Turn "the best placement" into concrete moves, priced, and decide when they are worth it.

A better placement is only worth reaching if the gain over a horizon beats what moving costs,
and a transient dip in the mix must not make the fleet thrash. So every move carries its cost
(bytes to move, how long it ties up GPUs, the pause its sessions see, how many sessions it
touches) and its predicted gain, and a hysteresis gate proposes a plan only when the
efficiency gap has stayed above a threshold for a hold time and the horizon gain pays for the
summed move cost.

The cheapest move wins for each change: a role change in place (no bytes), a warm migration
to the same GPU model (checkpoint, transfer, restore: weights, compiled graphs, KV and sessions
come back), a cold start on another GPU model (weights load fresh, sessions' KV is
recomputed), then plain starts and stops for count changes. Stops come last: every move is
make-before-break.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.gpus import GpuKind
from fleetshift_daemon.core.perfmodel import Deployment, ModelArch, PerfModel
from fleetshift_daemon.core.planner import (
    OptionCapacity,
    OptionKey,
    PlacedWorker,
    Placement,
    Planner,
    PlanningInput,
    Solution,
)
from fleetshift_daemon.core.routing import Role


class MoveKind(enum.Enum):
    ROLE_CHANGE = "role_change"
    MIGRATE = "migrate"
    COLD_START = "cold_start"
    START = "start"
    STOP = "stop"


_ORDER = {k: i for i, k in enumerate(MoveKind)}


@dataclass(frozen=True)
class MoveCostModel:
    network_gbps: float = 25.0  # GB/s node to node for a snapshot (200 Gb/s fabric)
    storage_gbps: float = 2.0  # GB/s weights load fresh from storage on a cold start
    warm_restore_s: float = 2.0  # restore compiled graphs and state after the transfer
    cold_start_s: float = 60.0  # compile and warm up on another GPU model
    role_change_s: float = 0.5
    cutover_s: float = 0.03  # session pause at the make-before-break switch (Llumnix: 20-30 ms)

    def __post_init__(self) -> None:
        for name in ("network_gbps", "storage_gbps"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0", field=name)


@dataclass(frozen=True)
class Move:
    kind: MoveKind
    model: str
    source: PlacedWorker | None
    target: PlacedWorker | None
    bytes_to_move: int
    duration_s: float  # until the destination serves (the source serves meanwhile)
    expected_pause_s: float  # what each affected session sees
    sessions_affected: int
    predicted_gain_tokens_per_s: float
    cost_tokens: float  # goodput given up while GPUs are tied up by the move
    reason: str

    @property
    def worker_id(self) -> str | None:
        src = self.source.worker_id if self.source else None
        return src or (self.target.worker_id if self.target else None)


@dataclass(frozen=True)
class Plan:
    moves: tuple[Move, ...]
    goodput_before: float
    goodput_after: float
    efficiency_before: float
    solver_status: str = ""  # the solve behind goodput_after: "optimal" or stopped at the limit
    solve_s: float = 0.0

    @property
    def gain_tokens_per_s(self) -> float:
        return self.goodput_after - self.goodput_before

    @property
    def total_cost_tokens(self) -> float:
        return sum(m.cost_tokens for m in self.moves)

    @property
    def bytes_to_move(self) -> int:
        return sum(m.bytes_to_move for m in self.moves)

    def pays_off(self, horizon_s: float) -> bool:
        return self.gain_tokens_per_s * horizon_s > self.total_cost_tokens


def build_plan(
    planner: Planner,
    perf: PerfModel,
    inp: PlanningInput,
    current: Placement,
    best: Solution | None = None,
    costs: MoveCostModel | None = None,
    max_evaluations: int = 64,
) -> Plan:
    """Moves from ``current`` to ``best.placement`` (solved here when not given)."""
    costs = costs or MoveCostModel()
    best = best or planner.solve(inp, current)
    target = best.placement
    keys = set(current.counts()) | set(target.counts())
    opts = {o.key: o for o in planner.options(inp, keys)}
    archs = {m.arch.name: m.arch for m in inp.models}
    kinds = {n.gpu.name: n.gpu for n in inp.nodes}
    pricing = _Pricer(perf, archs, kinds, opts, costs)

    moves = _match(current, target, pricing)
    before = planner.evaluate(inp, current, list(opts.values()))
    after = planner.evaluate(inp, target, list(opts.values()))
    opt_list = list(opts.values())
    moves = _with_gains(
        planner, inp, current, moves, before.goodput_tokens_per_s, max_evaluations, opt_list
    )
    eff = (
        1.0
        if after.goodput_tokens_per_s <= 0
        else min(1.0, before.goodput_tokens_per_s / after.goodput_tokens_per_s)
    )
    return Plan(
        tuple(moves),
        before.goodput_tokens_per_s,
        after.goodput_tokens_per_s,
        eff,
        solver_status=best.status,
        solve_s=best.solve_s,
    )


class _Pricer:
    def __init__(
        self,
        perf: PerfModel,
        archs: dict[str, ModelArch],
        kinds: dict[str, GpuKind],
        opts: dict[OptionKey, OptionCapacity],
        costs: MoveCostModel,
    ) -> None:
        self.perf, self.archs, self.kinds, self.opts, self.costs = perf, archs, kinds, opts, costs

    def dep(self, w: PlacedWorker) -> Deployment:
        return Deployment(self.archs[w.model], self.kinds[w.gpu_kind], w.tp, w.dtype)

    def capacity(self, w: PlacedWorker) -> float:
        o = self.opts.get(w.key)
        return 0.0 if o is None else o.prefill_tokens_per_s + o.decode_tokens_per_s

    def kv_bytes(self, w: PlacedWorker) -> int:
        return w.kv_used_tokens * self.perf.kv_bytes_per_token(self.dep(w))

    def weights(self, w: PlacedWorker) -> int:
        return self.perf.weight_bytes(self.dep(w))

    def recompute_s(self, src: PlacedWorker, dst: PlacedWorker) -> float:
        if src.kv_used_tokens <= 0:
            return 0.0
        co = self.perf.coefficients(self.dep(dst))
        return co.p0 + co.p_tok * src.kv_used_tokens

    def move(self, kind: MoveKind, src: PlacedWorker | None, dst: PlacedWorker | None) -> Move:
        c = self.costs
        w = dst or src
        assert w is not None
        sessions = src.live_sessions if src else 0
        if kind is MoveKind.ROLE_CHANGE:
            assert src is not None and dst is not None
            nbytes, duration = 0, c.role_change_s
            stops_decoding = dst.role is Role.PREFILL and src.role is not Role.PREFILL
            pause = c.cutover_s if stops_decoding else 0.0
            sessions = sessions if stops_decoding else 0
            why = f"{src.role.value} -> {dst.role.value} in place on {src.node}"
        elif kind is MoveKind.MIGRATE:
            assert src is not None and dst is not None
            nbytes = self.weights(src) + self.kv_bytes(src)
            duration = nbytes / (c.network_gbps * 1e9) + c.warm_restore_s
            pause = c.cutover_s
            why = f"warm migrate {src.node} -> {dst.node} ({dst.gpu_kind}, same GPU model)"
        elif kind is MoveKind.COLD_START:
            assert src is not None and dst is not None
            nbytes = self.weights(dst)
            recompute = self.recompute_s(src, dst)
            duration = nbytes / (c.storage_gbps * 1e9) + c.cold_start_s + recompute
            pause = recompute + c.cutover_s
            why = (
                f"cold start {src.gpu_kind} on {src.node} -> {dst.gpu_kind} on {dst.node}; "
                f"sessions carried as token history, KV recomputed"
            )
        elif kind is MoveKind.START:
            assert dst is not None
            nbytes = self.weights(dst)
            duration = nbytes / (c.storage_gbps * 1e9) + c.cold_start_s
            pause = 0.0
            why = f"start {dst.role.value} {dst.gpu_kind} x{dst.tp} on {dst.node}"
        else:
            assert src is not None
            nbytes, duration, pause = 0, 0.0, c.cutover_s if sessions else 0.0
            why = f"retire {src.role.value} {src.gpu_kind} x{src.tp} on {src.node} after the rest"
        # GPUs tied up without serving: the destination's capacity for the move's duration
        cost = duration * self.capacity(w) if kind is not MoveKind.STOP else 0.0
        return Move(kind, w.model, src, dst, nbytes, duration, pause, sessions, 0.0, cost, why)


def _same_shape(a: PlacedWorker, b: PlacedWorker) -> bool:
    return (a.model, a.gpu_kind, a.tp, a.dtype) == (b.model, b.gpu_kind, b.tp, b.dtype)


def _match(current: Placement, target: Placement, pricing: _Pricer) -> list[Move]:
    moves: list[Move] = []
    by_id = {w.worker_id: w for w in current.workers if w.worker_id}
    kept: set[str] = set()
    new_slots: list[PlacedWorker] = []
    for t in target.workers:
        src = by_id.get(t.worker_id) if t.worker_id else None
        if src is None:
            new_slots.append(t)
            continue
        kept.add(t.worker_id or "")
        if src.role is not t.role:
            moves.append(pricing.move(MoveKind.ROLE_CHANGE, src, t))
    leftovers = [w for w in current.workers if not (w.worker_id and w.worker_id in kept)]
    pools: dict[str, list[PlacedWorker]] = defaultdict(list)
    for w in leftovers:
        pools[w.model].append(w)
    for t in new_slots:
        pool = pools[t.model]
        same = next((w for w in pool if _same_shape(w, t)), None)
        if same is not None:
            pool.remove(same)
            moves.append(pricing.move(MoveKind.MIGRATE, same, _adopt(t, same)))
        elif pool:
            src = max(pool, key=lambda w: w.live_sessions)
            pool.remove(src)
            moves.append(pricing.move(MoveKind.COLD_START, src, _adopt(t, src)))
        else:
            moves.append(pricing.move(MoveKind.START, None, t))
    for pool in pools.values():
        for w in pool:
            moves.append(pricing.move(MoveKind.STOP, w, None))
    moves.sort(key=lambda m: _ORDER[m.kind])
    return moves


def _adopt(t: PlacedWorker, src: PlacedWorker) -> PlacedWorker:
    """The destination carries the source's id and sessions."""
    return PlacedWorker(
        t.model,
        t.role,
        t.gpu_kind,
        t.tp,
        t.dtype,
        t.node,
        src.worker_id,
        src.live_sessions,
        src.kv_used_tokens,
    )


def _apply(workers: dict[int, PlacedWorker], m: Move) -> None:
    if m.source is not None:
        workers.pop(id(m.source), None)
    if m.target is not None:
        workers[id(m.target)] = m.target


def _with_gains(
    planner: Planner,
    inp: PlanningInput,
    current: Placement,
    moves: Sequence[Move],
    before: float,
    max_evaluations: int,
    opts: Sequence[OptionCapacity],
) -> list[Move]:
    """Marginal goodput of each move, applied in order; beyond ``max_evaluations`` moves,
    consecutive moves share one evaluation and split its gain evenly."""
    if not moves:
        return []
    per = max(1, math.ceil(len(moves) / max(max_evaluations, 1)))
    workers = {id(w): w for w in current.workers}
    out: list[Move] = []
    prev = before
    for start in range(0, len(moves), per):
        chunk = moves[start : start + per]
        for m in chunk:
            _apply(workers, m)
        placement = Placement(tuple(workers.values()))
        now = planner.evaluate(inp, placement, opts).goodput_tokens_per_s
        share = (now - prev) / len(chunk)
        prev = now
        out.extend(_with_gain(m, share) for m in chunk)
    return out


def _with_gain(m: Move, gain: float) -> Move:
    return Move(
        m.kind,
        m.model,
        m.source,
        m.target,
        m.bytes_to_move,
        m.duration_s,
        m.expected_pause_s,
        m.sessions_affected,
        gain,
        m.cost_tokens,
        m.reason,
    )


# -- hysteresis -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HysteresisConfig:
    threshold: float = 0.05  # efficiency gap (1 - efficiency) that counts as wrong
    # A gap just past the threshold must last hold_s without a break; a wider one proportionally
    # less (4x the threshold holds hold_s / 4), never under min_hold_s (capped at hold_s): what
    # waiting costs grows with the gap, what a transient costs (moves undone later) does not.
    hold_s: float = 300.0
    min_hold_s: float = 60.0
    horizon_s: float = 3600.0  # gain is counted over this horizon against the move cost

    def __post_init__(self) -> None:
        if not 0 <= self.threshold < 1:
            raise InvalidArgument("threshold must be in [0, 1)", field="threshold")
        if self.hold_s < 0 or self.horizon_s <= 0:
            raise InvalidArgument("hold_s >= 0 and horizon_s > 0 required", field="hold_s")
        if not (math.isfinite(self.min_hold_s) and self.min_hold_s >= 0):
            raise InvalidArgument("min_hold_s must be >= 0", field="min_hold_s")

    def hold_for(self, gap: float) -> float:
        """How long a gap of this size must persist before a plan may be proposed."""
        if gap <= 0 or self.threshold <= 0:
            return self.hold_s
        floor = min(self.min_hold_s, self.hold_s)
        return max(floor, min(self.hold_s, self.hold_s * self.threshold / gap))


@dataclass(frozen=True)
class HysteresisDecision:
    propose: bool
    gap: float
    gap_since: float | None
    reason: str


class Hysteresis:
    """Holds back plans until a gap is persistent and moving pays for itself."""

    def __init__(self, clock: Callable[[], float], config: HysteresisConfig | None = None) -> None:
        self._clock = clock
        self._cfg = config or HysteresisConfig()
        self._since: float | None = None

    def observe(self, efficiency: float, plan: Plan | None = None) -> HysteresisDecision:
        """The verdict now, with the gap's clock advanced by it (the periodic pass)."""
        decision = self.judge(efficiency, plan)
        self._since = decision.gap_since
        return decision

    def judge(self, efficiency: float, plan: Plan | None = None) -> HysteresisDecision:
        """The verdict ``observe`` would give now, changing nothing: an operator's dry run
        must see the gate's answer without starting (or resetting) the gap's clock."""
        if not (math.isfinite(efficiency) and 0 <= efficiency <= 1):
            raise InvalidArgument("efficiency must be in [0, 1]", field="efficiency")
        cfg, now = self._cfg, self._clock()
        gap = 1.0 - efficiency
        if gap <= cfg.threshold:
            return HysteresisDecision(
                False, gap, None, f"gap {gap:.1%} within threshold {cfg.threshold:.1%}"
            )
        since = now if self._since is None else self._since
        held, hold = now - since, cfg.hold_for(gap)
        if held < hold:
            return HysteresisDecision(
                False,
                gap,
                since,
                f"gap {gap:.1%} for {held:.0f} s, holding for {hold:.0f} s",
            )
        if plan is None:
            return HysteresisDecision(False, gap, since, "gap persists; no plan given")
        gain = plan.gain_tokens_per_s * cfg.horizon_s
        if not plan.pays_off(cfg.horizon_s):
            return HysteresisDecision(
                False,
                gap,
                since,
                f"gain {gain:,.0f} tokens over {cfg.horizon_s:.0f} s does not beat move cost "
                f"{plan.total_cost_tokens:,.0f} tokens",
            )
        return HysteresisDecision(
            True,
            gap,
            since,
            f"gap {gap:.1%} for {held:.0f} s; gain {gain:,.0f} tokens over {cfg.horizon_s:.0f} s "
            f"beats move cost {plan.total_cost_tokens:,.0f} tokens ({len(plan.moves)} moves)",
        )
