"""Measured SLO attainment from what workers report, and whether it puts the SLO at risk.

The planner sizes a fleet from a model of it; the model can be wrong (a burst it cannot see,
interference it leaves out, a mis-calibrated GPU), and a wrong model says the placement is
ideal while requests miss their SLO. This monitor closes the loop on what the workers
*measured*: each heartbeat carries a worker's TTFT and TBT percentiles (p50, p99) and its
queue depth, and the monitor turns them into

* an estimate of the share of requests meeting the SLO (attainment), published beside the
  efficiency figure so that reality, not only the model, can alert;
* ``at_risk``: the latest round of reports says the SLO is being missed, or queues keep
  growing: capacity must come back now, without waiting for the hysteresis hold;
* ``retire_ok``: attainment has stayed at or above a margin over the target for a sustained
  time: only then may capacity be retired.

Heartbeats carry two percentiles, not every request, so the share meeting a threshold is
estimated by fitting a log-normal through (p50, p99) per worker and metric (latencies are
positive and right-skewed; two quantiles pin a log-normal exactly). A worker's share is the
lower of its TTFT and TBT shares (a request needs both), and the fleet's is the mean over
workers weighted by their live sessions. The clock is injected; the daemon feeds it from
heartbeats and the simulator from its simulated workers, through the same ``observe``.
"""

from __future__ import annotations

import itertools
import math
import operator
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from fleetshift_common.errors import InvalidArgument
from fleetshift_common.vocabulary import Role
from fleetshift_daemon.core.fleet import WorkerCounters

KV_BLOCK_TOKENS = 16  # the reference engine's block size; counters report blocks
_Z99 = 2.3263478740408408  # standard normal quantile of 0.99


@dataclass(frozen=True)
class LatencySample:
    """One worker's latency report, as a heartbeat carries it (0 = no data yet)."""

    worker_id: str
    model: str
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    tbt_p50_ms: float = 0.0
    tbt_p99_ms: float = 0.0
    queue_depth: int = 0
    live_sessions: int = 0
    # what tells a decode shortage from a prefill one: the worker's role (a decode worker's
    # queue is hand-offs waiting for KV memory) and its KV use (requests queued on a worker
    # whose KV is full wait for memory, not for compute)
    role: Role = Role.MIXED
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0

    @property
    def has_latency(self) -> bool:
        return self.ttft_p50_ms > 0 or self.tbt_p50_ms > 0

    def kv_full(self, fraction: float) -> bool:
        return self.kv_total_tokens > 0 and self.kv_used_tokens >= fraction * self.kv_total_tokens

    def decode_side(self, fraction: float) -> bool:
        """Whether this worker's queue waits on the decode side: hand-offs queued on a decode
        worker, or prompts queued on a prefill worker whose KV is full (held by prompts whose
        hand-off waits for decode memory). A mixed worker's queue counts as prompts waiting:
        a full KV there is short of both phases at once (see ``memory_bound``)."""
        return self.role is Role.DECODE or (self.role is Role.PREFILL and self.kv_full(fraction))

    def memory_bound(self, fraction: float) -> bool:
        """Requests wait on this worker behind a KV at least ``fraction`` full."""
        return self.queue_depth > 0 and self.kv_full(fraction)


def sample_from_counters(counters: WorkerCounters, model: str, role: Role) -> LatencySample:
    """A heartbeat's worker counters as the monitor reads them: the one conversion the daemon
    (real heartbeats) and the simulator (its simulated workers' counters) both use."""
    return LatencySample(
        counters.worker_id,
        model,
        counters.ttft_p50_ms,
        counters.ttft_p99_ms,
        counters.tbt_p50_ms,
        counters.tbt_p99_ms,
        counters.queue_depth,
        counters.live_sessions,
        role,
        counters.kv_blocks_used * KV_BLOCK_TOKENS,
        counters.kv_blocks_total * KV_BLOCK_TOKENS,
    )


@dataclass(frozen=True)
class SloMonitorConfig:
    target: float = 0.99  # share of requests that must meet the SLO
    # Retiring needs attainment at or above target + retire_margin for retire_hold_s without
    # a break: one quiet heartbeat is no evidence the fleet can spare a worker.
    retire_margin: float = 0.005
    retire_hold_s: float = 600.0
    window_s: float = 300.0  # reports older than this are forgotten
    # Queue growth: the model's summed queue depth rose in each of this many consecutive
    # rounds, ending at least growth_factor above where the rise started.
    queue_growth_rounds: int = 3
    queue_growth_factor: float = 2.0
    queue_floor: int = 1  # a queue at or below this is never "growing"
    # A worker whose KV is at least this full with requests queued is memory-bound: its
    # queue is a decode shortage (issue 11: hand-offs waiting for decode KV held the prefill
    # workers' memory, their prompt queues grew, and every such queue was read as a prefill
    # shortage). A block-granular allocator is "full" a few blocks short of its total, and a
    # long request needs a few percent of it; 0.9 is that bar, not tuned.
    kv_full_fraction: float = 0.9
    # A round is the fleet's picture at one time (see ``SloMonitor.observe``): it closes when
    # a worker in it reports again or once it is this old. The daemon sets it to its
    # heartbeat interval; the default is the daemon's default interval (config.py).
    round_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.target < 1:
            raise InvalidArgument("target must be in (0, 1)", field="target")
        if not 0 <= self.retire_margin < 1 - self.target:
            raise InvalidArgument("retire_margin must be in [0, 1 - target)", field="retire_margin")
        for name in ("retire_hold_s", "window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{name} must be >= 0", field=name)
        if not (math.isfinite(self.round_s) and self.round_s > 0):
            raise InvalidArgument("round_s must be > 0", field="round_s")
        if not 0 < self.kv_full_fraction <= 1:
            raise InvalidArgument("kv_full_fraction must be in (0, 1]", field="kv_full_fraction")
        if self.queue_growth_rounds < 1 or not self.queue_growth_factor >= 1:
            raise InvalidArgument(
                "queue_growth_rounds >= 1 and queue_growth_factor >= 1 required",
                field="queue_growth_rounds",
            )


@dataclass(frozen=True)
class SloThresholds:
    """The model's SLO in milliseconds, as the planner's ``SloTarget`` states it."""

    ttft_ms: float
    tbt_ms: float


@dataclass(frozen=True)
class SloAssessment:
    model: str
    attainment: float | None  # over the window; None without any latency report
    current: float | None  # the latest round of reports only
    target: float
    at_risk: bool
    retire_ok: bool
    margin_since: float | None
    reason: str
    # which phase misses: the latest round's TTFT and TBT shares, and whether queues grow
    ttft_current: float | None = None
    tbt_current: float | None = None
    queue_growing: bool = False  # either side's
    # the queue split by the side it waits on (see ``LatencySample.decode_side``), and
    # whether any worker now holds requests queued behind a full KV
    prefill_queue_growing: bool = False
    decode_queue_growing: bool = False
    memory_bound: bool = False  # some worker has requests queued behind a full KV
    handoff_blocked: bool = False  # ... and it is a split worker (hand-offs wait on memory)
    # how many workers the prefill and the decode pool can each spare (see ``_pool_spare``)
    prefill_spare: int = 0
    decode_spare: int = 0

    @property
    def prefill_short(self) -> bool:
        """Prompts wait for prefill compute: their queue grows, or TTFT misses while no
        hand-off waits for decode memory (a prompt blocked behind KV held for a hand-off
        misses its TTFT too, and more prefill would only queue more hand-offs)."""
        if self.prefill_queue_growing:
            return True
        ttft_miss = self.ttft_current is not None and self.ttft_current < self.target
        return ttft_miss and not (self.handoff_blocked or self.decode_queue_growing)

    @property
    def decode_short(self) -> bool:
        """Decode capacity (compute or KV memory) is short: TBT misses, hand-offs queue up,
        or requests wait behind a full KV."""
        tbt_miss = self.tbt_current is not None and self.tbt_current < self.target
        return tbt_miss or self.decode_queue_growing or self.memory_bound

    @property
    def one_phase_short(self) -> bool:
        """The measurements attribute the risk to exactly one phase."""
        return self.prefill_short != self.decode_short

    @property
    def gap(self) -> float:
        """How far measured attainment is below the target (0 when at or above it)."""
        return 0.0 if self.attainment is None else max(0.0, self.target - self.attainment)


def share_within(p50: float, p99: float, threshold: float) -> float:
    """Share of a log-normal latency with these percentiles at or below ``threshold``."""
    if p50 <= 0 and p99 <= 0:
        return 1.0  # nothing measured on this metric
    p50 = max(p50, 1e-9)
    p99 = max(p99, p50)
    if threshold <= 0:
        return 0.0
    sigma = math.log(p99 / p50) / _Z99
    z = math.log(threshold / p50)
    if sigma <= 1e-12:
        return 1.0 if z >= 0 else 0.0
    return 0.5 * math.erfc(-z / (sigma * math.sqrt(2.0)))


def sample_attainment(s: LatencySample, slo: SloThresholds) -> float:
    """A request must meet both TTFT and TBT: the lower of the two shares."""
    return min(
        share_within(s.ttft_p50_ms, s.ttft_p99_ms, slo.ttft_ms),
        share_within(s.tbt_p50_ms, s.tbt_p99_ms, slo.tbt_ms),
    )


# A round keeps its reports as numbers, not as ``LatencySample`` objects: a full window holds
# every worker's report of every round (2,000 workers x 300 rounds at the load bench's fleet,
# 600,000 reports), and one object per report made every full collection of the daemon's
# GC walk them all (0.5-1.6 s pauses on its event loop, docs/benchmarks.md, fs-17g). A
# report is one row of ``_WIDTH`` doubles in an ``array`` (which the collector does not
# track) and its worker a slot number; a round holds a fixed handful of objects whatever the
# fleet's size. Doubles hold the reports exactly: latencies are floats, and the integer
# fields (queue depth, sessions, KV tokens: uint32 on the wire, x16 for tokens) are far
# below 2**53. Every figure is computed from the rows in the order the reports had before,
# with the same arithmetic, so the assessments are the same to the bit
# (tests/core/test_slo_monitor_rows.py compares them with the per-object monitor).
_ROLES = tuple(Role)
_ROLE_CODE = {r: float(i) for i, r in enumerate(_ROLES)}
_TTFT50, _TTFT99, _TBT50, _TBT99, _QUEUE, _LIVE, _ROLE, _KV_USED, _KV_TOTAL = range(9)
_WIDTH = 9
# which workers' queues a queue-growth test counts (see ``_Round.queued``)
_PREFILL_SIDE, _DECODE_SIDE = "prefill side", "decode side"
_QueueKey = Role | str


def _row(s: LatencySample) -> array[float]:
    return array(
        "d",
        (
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.tbt_p50_ms,
            s.tbt_p99_ms,
            s.queue_depth,
            s.live_sessions,
            _ROLE_CODE[s.role],
            s.kv_used_tokens,
            s.kv_total_tokens,
        ),
    )


def _sample(row: Sequence[float], worker_id: str, model: str) -> LatencySample:
    return LatencySample(
        worker_id,
        model,
        row[_TTFT50],
        row[_TTFT99],
        row[_TBT50],
        row[_TBT99],
        row[_QUEUE],  # type: ignore[arg-type]  # an integer held as a double (exact)
        row[_LIVE],  # type: ignore[arg-type]
        _ROLES[int(row[_ROLE])],
        row[_KV_USED],  # type: ignore[arg-type]
        row[_KV_TOTAL],  # type: ignore[arg-type]
    )


class _Round:
    """One round's reports: ``slots[i]`` is the worker of row ``i`` (``data[i * _WIDTH:]``),
    rows in the order the workers first reported in the round. ``index`` (slot -> row) is
    kept while the round is the model's latest, the only one reports join; ``cache`` holds
    what assessments derive from the rows (a round no report joins any more does not
    change, so its scores are computed once), emptied whenever the rows change."""

    __slots__ = ("at", "cache", "data", "index", "seq", "slots")

    def __init__(self, at: float, seq: int) -> None:
        self.at = at
        self.seq = seq
        self.slots = array("l")
        self.data = array("d")
        self.index: dict[int, int] | None = {}
        self.cache: dict[object, object] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def put(self, slot: int, row: array[float]) -> None:
        assert self.index is not None  # only the latest round takes reports
        self.cache.clear()
        i = self.index.get(slot)
        if i is None:
            self.index[slot] = len(self.slots)
            self.slots.append(slot)
            self.data.extend(row)
        else:  # the worker's newer report replaces its older one, in its place
            self.data[i * _WIDTH : (i + 1) * _WIDTH] = row

    def drop(self, slot: int) -> bool:
        if slot not in self.slots:
            return False
        i = self.slots.index(slot)
        del self.slots[i]
        del self.data[i * _WIDTH : (i + 1) * _WIDTH]
        if self.index is not None:
            self.index = {s: k for k, s in enumerate(self.slots)}
        self.cache.clear()
        return True

    def rows(self) -> Iterator[list[float]]:
        values = self.data.tolist()  # one pass in C; slicing a list is cheaper than an array
        for i in range(0, len(values), _WIDTH):
            yield values[i : i + _WIDTH]

    def scored(self, slo: SloThresholds, role: Role | None) -> tuple[array[float], array[float]]:
        """``_weighted``'s terms over this round's reports (those of ``role`` workers, or
        all), in order: each weight times its attainment, and each weight."""
        key = (slo, role)
        hit = self.cache.get(key)
        if hit is None:
            code = None if role is None else _ROLE_CODE[role]
            terms, weights = array("d"), array("d")
            for row in self.rows():
                if code is not None and row[_ROLE] != code:
                    continue
                if not (row[_TTFT50] > 0 or row[_TBT50] > 0):  # LatencySample.has_latency
                    continue
                w = float(max(row[_LIVE], 1))
                weights.append(w)
                terms.append(w * _row_attainment(row, slo))
            hit = self.cache[key] = (terms, weights)
        return hit  # type: ignore[return-value]

    def memory_bound(self, role: Role, fraction: float) -> bool:
        """Some ``role`` worker holds requests queued behind a KV at least ``fraction`` full."""
        key = ("memory bound", role, fraction)
        hit = self.cache.get(key)
        if hit is None:
            code = _ROLE_CODE[role]
            hit = self.cache[key] = any(
                row[_ROLE] == code and row[_QUEUE] > 0 and _kv_full(row, fraction)
                for row in self.rows()
            )
        return bool(hit)

    def queued(self, key: _QueueKey, fraction: float) -> array[float]:
        """Each worker's queue depth if ``key`` counts it, else 0, in row order: the prefill
        or the decode side's (``LatencySample.decode_side``), or a role's workers' queue."""
        cache_key = ("queued", fraction)
        hit = self.cache.get(cache_key)
        if hit is None:  # the four in one pass
            prefill_side, decode_side, prefill, decode = (array("d") for _ in range(4))
            p_code, d_code = _ROLE_CODE[Role.PREFILL], _ROLE_CODE[Role.DECODE]
            for row in self.rows():
                q, code = row[_QUEUE], row[_ROLE]
                on_decode = code == d_code or (code == p_code and _kv_full(row, fraction))
                decode_side.append(q if on_decode else 0.0)
                prefill_side.append(0.0 if on_decode else q)
                prefill.append(q if code == p_code else 0.0)
                decode.append(q if code == d_code else 0.0)
            hit = self.cache[cache_key] = {
                _PREFILL_SIDE: prefill_side,
                _DECODE_SIDE: decode_side,
                Role.PREFILL: prefill,
                Role.DECODE: decode,
            }
        return hit[key]  # type: ignore[index, no-any-return]


def _kv_full(row: Sequence[float], fraction: float) -> bool:
    """``LatencySample.kv_full`` on a row."""
    return row[_KV_TOTAL] > 0 and row[_KV_USED] >= fraction * row[_KV_TOTAL]


def _row_attainment(row: Sequence[float], slo: SloThresholds) -> float:
    """``sample_attainment`` on a row."""
    return min(
        share_within(row[_TTFT50], row[_TTFT99], slo.ttft_ms),
        share_within(row[_TBT50], row[_TBT99], slo.tbt_ms),
    )


def _add_up(total: float, terms: Iterable[float]) -> float:
    """``total + t1 + t2 + ...`` left to right (``sum`` may compensate; this must not, so that
    a window's figure is the one the per-report loop gave)."""
    return deque(itertools.accumulate(terms, operator.add, initial=total), maxlen=1)[0]


@dataclass
class _Workers:
    """A model's worker ids as small numbers (slots), so that a round's rows hold no strings.
    A slot is held while some kept round has the worker's report (``last_seq``: the newest
    such round) and given back when that round is evicted or the worker is forgotten."""

    slot_of: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    last_seq: array[int] = field(default_factory=lambda: array("q"))
    free: list[int] = field(default_factory=list)

    def slot(self, worker_id: str) -> int:
        slot = self.slot_of.get(worker_id)
        if slot is None:
            if self.free:
                slot = self.free.pop()
                self.names[slot] = worker_id
            else:
                slot = len(self.names)
                self.names.append(worker_id)
                self.last_seq.append(-1)
            self.slot_of[worker_id] = slot
        return slot

    def release(self, slot: int) -> None:
        del self.slot_of[self.names[slot]]
        self.names[slot] = ""
        self.last_seq[slot] = -1
        self.free.append(slot)


@dataclass
class _ModelState:
    rounds: deque[_Round] = field(default_factory=deque)
    margin_since: float | None = None
    workers: _Workers = field(default_factory=_Workers)
    next_seq: int = 0
    view: bool = False  # a dry run's copy: evicting it must not give back slots


class SloMonitor:
    """Thread-safe: heartbeats observe from the RPC threads while the planning job assesses."""

    def __init__(self, clock: Callable[[], float], config: SloMonitorConfig | None = None) -> None:
        self._clock = clock
        self._cfg = config or SloMonitorConfig()
        self._models: dict[str, _ModelState] = {}
        self._lock = threading.Lock()

    @property
    def config(self) -> SloMonitorConfig:
        return self._cfg

    def observe(self, samples: Iterable[LatencySample]) -> None:
        """One batch of reports: a node's heartbeat, or all simulated workers at one instant.

        A round is the model's fleet at one time, each worker's latest report as of it: the
        queue-growth rule compares the model's summed queue round to round, and the pool
        checks read each round's attainment. The daemon receives each node's heartbeat at its
        own time, so a round cannot be one clock reading (that made every heartbeat a round
        of one node's workers, and kept a round per heartbeat: tens of thousands at 1,000
        nodes, walked by every GC pass). So a batch joins the current round unless one of its
        workers already reported in it (its report is the next picture of that worker) or
        the round is ``round_s`` (one heartbeat interval) old; then it opens the next round.
        Every node heartbeats once an interval, so a round collects each node once, and the
        monitor keeps ``window_s / interval`` rounds whatever the fleet's size. A batch at the
        round's own clock reading always joins it (one instant is one picture): the
        simulator's ticks, all workers at once, each repeat a worker of the tick before and
        so make one round each, as before. A worker's newer report in a round replaces its
        older one; queue sums carry each worker's latest report forward (``_queue_growing``)."""
        batch = list(samples)
        for s in batch:  # all or nothing: a bad report changes nothing
            _check(s)
        rows = [_row(s) for s in batch]
        now = self._clock()
        by_model: dict[str, list[tuple[LatencySample, array[float]]]] = {}
        for s, row in zip(batch, rows, strict=True):
            by_model.setdefault(s.model, []).append((s, row))
        with self._lock:
            for model, reports in by_model.items():
                state = self._models.setdefault(model, _ModelState())
                workers = state.workers
                if self._opens_round(state, [s for s, _ in reports], now):
                    if state.rounds:
                        state.rounds[-1].index = None  # no report joins it any more
                    state.rounds.append(_Round(now, state.next_seq))
                    state.next_seq += 1
                last = state.rounds[-1]
                for s, row in reports:
                    slot = workers.slot(s.worker_id)
                    workers.last_seq[slot] = last.seq
                    last.put(slot, row)
            for state in self._models.values():
                self._evict(state, now)

    def _opens_round(self, state: _ModelState, reports: list[LatencySample], now: float) -> bool:
        if not state.rounds:
            return True
        last = state.rounds[-1]
        if last.at == now:
            return False
        if now - last.at >= self._cfg.round_s:
            return True
        slot_of, index = state.workers.slot_of, last.index or {}
        return any(slot_of.get(s.worker_id, -1) in index for s in reports)

    def forget_worker(self, worker_id: str) -> None:
        with self._lock:
            for state in self._models.values():
                slot = state.workers.slot_of.get(worker_id)
                if slot is None:
                    continue
                for r in state.rounds:
                    r.drop(slot)
                state.workers.release(slot)

    def _evict(self, state: _ModelState, now: float) -> None:
        horizon = now - self._cfg.window_s
        workers = state.workers
        while state.rounds and state.rounds[0].at < horizon:
            gone = state.rounds.popleft()
            if state.view:
                continue
            for slot in gone.slots:
                if workers.last_seq[slot] == gone.seq:  # its newest report goes with it
                    workers.release(slot)

    def assess(self, model: str, slo: SloThresholds, *, record: bool = True) -> SloAssessment:
        """Attainment, risk and whether retiring is allowed, as of now.

        ``record=False`` (an operator's dry run) gives the same answer on a copy of the
        model's state: the margin's clock (``margin_since``, which gates retirements) must
        not start or reset because an operator asked."""
        with self._lock:
            return self._assess(model, slo, record)

    def _assess(self, model: str, slo: SloThresholds, record: bool = True) -> SloAssessment:
        cfg, now = self._cfg, self._clock()
        state = self._models.get(model)
        if state is None:
            state = self._models.setdefault(model, _ModelState()) if record else _ModelState()
        elif not record:
            state = _ModelState(
                deque(state.rounds), state.margin_since, state.workers, state.next_seq, True
            )
        self._evict(state, now)
        latest = _latest_per_worker(state, model)
        current = _weighted(latest.values(), slo)
        attainment = _window_attainment(state.rounds, slo)
        frac = cfg.kv_full_fraction
        grow_p = self._queue_growing(state, _PREFILL_SIDE)
        grow_d = self._queue_growing(state, _DECODE_SIDE)
        growing = grow_p or grow_d
        full = [s for s in latest.values() if s.memory_bound(frac)]
        split_full = any(s.role is not Role.MIXED for s in full)
        at_risk = (current is not None and current < cfg.target) or growing
        # No latency at all (no request finished in the window) misses nothing: an idle
        # model's surplus may retire once the hold has passed.
        margin = current is None or current >= cfg.target + cfg.retire_margin
        if margin and not growing:
            if state.margin_since is None:
                state.margin_since = now
        else:
            state.margin_since = None
        held = 0.0 if state.margin_since is None else now - state.margin_since
        retire_ok = state.margin_since is not None and held >= cfg.retire_hold_s
        reason = _reason(current, attainment, cfg, growing, held, retire_ok)
        ttft_slo = SloThresholds(slo.ttft_ms, math.inf)
        tbt_slo = SloThresholds(math.inf, slo.tbt_ms)
        return SloAssessment(
            model,
            attainment,
            current,
            cfg.target,
            at_risk,
            retire_ok,
            state.margin_since,
            reason,
            _weighted(latest.values(), ttft_slo),
            _weighted(latest.values(), tbt_slo),
            growing,
            grow_p,
            grow_d,
            bool(full),
            split_full,
            self._pool_spare(state, latest, Role.PREFILL, ttft_slo),
            self._pool_spare(state, latest, Role.DECODE, tbt_slo),
        )

    def _pool_spare(
        self, state: _ModelState, latest: dict[str, LatencySample], role: Role, slo: SloThresholds
    ) -> int:
        """How many workers the pool of ``role`` workers has measured margin to give away.

        A role change off a pool is a retirement from that phase, and a retirement needs
        evidence of margin, not the absence of evidence of a miss: the pool's own latency
        (TTFT for prefill, TBT for decode) meets the target in the latest round (a pool that
        finished nothing holds nothing back: as for ``retire_ok``, it misses nothing), none of its
        workers waits behind a full KV, its queue is not growing over the growth test's
        horizon (which must be fully observed), and the KV it holds would still fit, below
        ``kv_full_fraction``, on the workers that stay (the largest leave first)."""
        cfg = self._cfg
        if len(state.rounds) < cfg.queue_growth_rounds + 1:
            return 0
        pool = [s for s in latest.values() if s.role is role]
        share = _weighted(pool, slo)
        if share is not None and share < cfg.target:  # none measured: an idle pool misses nothing
            return 0
        if any(s.memory_bound(cfg.kv_full_fraction) for s in pool):
            return 0
        if self._queue_growing(state, role):
            return 0
        used = sum(s.kv_used_tokens for s in pool)
        room = sorted((s.kv_total_tokens for s in pool), reverse=True)
        spare = 0
        while spare < len(room) and used <= cfg.kv_full_fraction * sum(room[spare + 1 :]):
            spare += 1
        return spare

    def pool_held(self, model: str, role: Role, slo: SloThresholds, since: float) -> bool:
        """Whether the pool of ``role`` workers has had margin at every round after ``since``,
        over at least the growth test's horizon (``queue_growth_rounds + 1`` rounds): its own
        latency (TTFT for prefill, TBT for decode) within the target, and none of its workers
        waiting behind a full KV, in each of them. Margin that has held since a move, not one
        reading: a pool just given a worker reads well because that worker relieved it."""
        cfg = self._cfg
        own = (
            SloThresholds(slo.ttft_ms, math.inf)
            if role is Role.PREFILL
            else SloThresholds(math.inf, slo.tbt_ms)
        )
        with self._lock:
            state = self._models.get(model)
            rounds = [r for r in state.rounds if r.at > since] if state else []
            if len(rounds) < cfg.queue_growth_rounds + 1:
                return False
            for r in rounds:
                terms, weights = r.scored(own, role)
                if weights:  # none measured misses nothing
                    share = _add_up(0.0, terms) / _add_up(0.0, weights)
                    if share < cfg.target:
                        return False
                if r.memory_bound(role, cfg.kv_full_fraction):
                    return False
            return True

    def _queue_growing(self, state: _ModelState, key: _QueueKey) -> bool:
        """The summed queue of the workers ``key`` counts (each worker's latest report as
        of each round) rose in each of the last rounds and ended well above where the rise
        started."""
        cfg = self._cfg
        n = cfg.queue_growth_rounds + 1
        if len(state.rounds) < n:
            return False
        seen: dict[int, float] = {}
        hist: list[float] = []
        first = len(state.rounds) - n  # only the last n sums are compared
        for k, r in enumerate(state.rounds):
            seen.update(zip(r.slots, r.queued(key, cfg.kv_full_fraction), strict=True))
            if k >= first:
                hist.append(sum(seen.values()))
        if hist[-1] <= cfg.queue_floor:
            return False
        rising = all(b > a for a, b in itertools.pairwise(hist))
        return rising and hist[-1] >= cfg.queue_growth_factor * max(hist[0], cfg.queue_floor)


def _latest_per_worker(state: _ModelState, model: str) -> dict[str, LatencySample]:
    """Each worker's newest report in the kept rounds, in the order workers first appear."""
    where: dict[int, tuple[_Round, int]] = {}
    for r in state.rounds:
        where.update(
            zip(r.slots, zip(itertools.repeat(r), range(len(r)), strict=False), strict=True)
        )
    names = state.workers.names
    return {
        names[slot]: _sample(r.data[i * _WIDTH : (i + 1) * _WIDTH], names[slot], model)
        for slot, (r, i) in where.items()
    }


def _window_attainment(rounds: Iterable[_Round], slo: SloThresholds) -> float | None:
    """``_weighted`` over every kept report, in order (each round's terms computed once)."""
    total = weight = 0.0
    for r in rounds:
        terms, weights = r.scored(slo, None)
        total = _add_up(total, terms)
        weight = _add_up(weight, weights)
    return None if weight == 0 else total / weight


def _weighted(samples: Iterable[LatencySample], slo: SloThresholds | None = None) -> float | None:
    """Session-weighted mean attainment of the samples with latency data; None if none."""
    total = weight = 0.0
    for s in samples:
        if not s.has_latency:
            continue
        w = float(max(s.live_sessions, 1))
        weight += w
        total += w * (1.0 if slo is None else sample_attainment(s, slo))
    return None if weight == 0 else total / weight


def _check(s: LatencySample) -> None:
    for name in ("ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms"):
        value = getattr(s, name)
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgument(f"{name} must be a finite number >= 0", field=name)
    if s.queue_depth < 0 or s.live_sessions < 0:
        raise InvalidArgument("queue_depth and live_sessions must be >= 0", field="queue_depth")


def _reason(
    current: float | None,
    attainment: float | None,
    cfg: SloMonitorConfig,
    growing: bool,
    held: float,
    retire_ok: bool,
) -> str:
    if current is None:
        return "queues growing, no latency reported yet" if growing else "no latency reported"
    parts = [f"measured {current:.1%} now, {attainment or 0.0:.1%} over the window"]
    if current < cfg.target:
        parts.append(f"below the {cfg.target:.1%} target: SLO at risk")
    if growing:
        parts.append("queues growing: SLO at risk")
    if retire_ok:
        parts.append(f"margin held {held:.0f} s: retiring allowed")
    else:
        parts.append(f"margin held {held:.0f} of {cfg.retire_hold_s:.0f} s: no retiring")
    return "; ".join(parts)
