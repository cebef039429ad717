"""A discrete-event simulator of a fleet of LLM instances serving a trace.

Each instance iterates as a continuous-batching engine does (vLLM's default scheduler):

* at every iteration boundary it first admits waiting prompts, oldest first, up to a token
  budget and a batch-size cap, reserving KV for the whole sequence (prompt + output; the
  simulator knows output lengths, a real engine reserves as it goes and preempts);
* an iteration that holds prompts costs ``prefill_time(prompts) + decode_step(batch)``: the
  running decodes wait for the prefill, which is the interference a phase split removes;
* otherwise it runs decode steps for the running batch, each step's time growing with the
  batch's summed context.

Decode steps of an unchanged batch are simulated as one event ("macro-step") up to the next
completion; an arrival, a finished KV transfer or a move cuts it at the next step boundary.
So the event count is a few per request, not one per token.

Instances in the PREFILL role hand each prompt's KV to a decode instance chosen when the
prompt finishes. The KV stays reserved on the prefill side until the decode instance has room
and the transfer (bytes / bandwidth: NVLink within a node, the node's NICs between nodes, all
TP shards in parallel) completes. Transfers are not overlapped with the prefill (Splitwise
overlaps them layer by layer) and links are not modelled as contended.
"""

from __future__ import annotations

import copy
import enum
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleetshift_daemon.core.perfmodel import Deployment, PerfModel
from fleetshift_daemon.sim.fleet import NodeGroup, SimFleet
from fleetshift_daemon.sim.timing import StepTimer
from fleetshift_daemon.sim.trace import FloatArray, IntArray, Trace

_KV_LATENCY_S = 1e-3
_I64 = np.int64


class Role(enum.Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"
    OFF = "off"  # out of service: takes no new work, finishes what it holds, then unbilled


@dataclass(frozen=True)
class SimConfig:
    max_batch: int = 1024
    prefill_token_budget: int = 8192
    kv_reserve_fraction: float = 0.1
    drain_s: float = 1800.0  # after the last arrival; what is unfinished then is dropped
    bucket_s: float = 60.0  # time-series resolution


class Event(enum.IntEnum):
    STEP_END = 0
    KV_DONE = 1
    RESUME = 2
    TICK = 3
    ACTION = 4


@dataclass(frozen=True)
class Move:
    time_s: float
    instance: int
    gpu: str
    before: str
    after: str
    kind: str
    cost_s: float


class Policy(Protocol):
    name: str
    tick_s: float | None

    def setup(self, sim: Simulator) -> None: ...

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None: ...

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance: ...

    def on_tick(self, sim: Simulator, t: float) -> None: ...


class Instance:
    """One model instance (a TP group on one node) and its continuous-batching state."""

    def __init__(
        self, idx: int, node: int, group: NodeGroup, dep: Deployment, timer: StepTimer, cap: int
    ) -> None:
        self.idx = idx
        self.node = node
        self.group = group
        self.gpu = group.gpu
        self.dep = dep
        self.timer = timer
        self.kv_cap = cap
        self.role = Role.MIXED
        self.waiting: deque[int] = deque()
        self.wait_tokens = 0
        self.handoff: deque[int] = deque()
        self.handoff_tokens = 0
        self.ready: list[int] = []
        self.run_ids = np.empty(0, _I64)
        self.run_left = np.empty(0, _I64)
        self.run_ctx = np.empty(0, _I64)
        self.run_last = np.empty(0, np.float64)
        self.run_gap = np.empty(0, np.float64)
        self.left_sum = 0
        self.kv_used = 0
        self.kv_incoming = 0
        self.version = 0
        self.in_step = False
        self.step_start = 0.0
        self.step_cum: FloatArray = np.empty(0)
        self.step_prefills: list[tuple[int, bool]] = []
        self.inflight_prompt_tokens = 0  # prompts in the prefill pass now running
        self.inflight_tokens = 0  # ... plus the tokens they will decode here
        self.paused_until = 0.0
        self.busy_s = 0.0
        self.prefill_tokens_done = 0  # the counters a worker reports in its heartbeat
        self.decode_tokens_done = 0
        self.bill_start: float | None = 0.0
        self.billed_s = 0.0

    @property
    def batch(self) -> int:
        return len(self.run_ids)

    def steps_done(self, t: float) -> int:
        if not self.in_step or self.step_prefills:
            return 0
        return int(np.searchsorted(self.step_cum, t - self.step_start, side="right"))

    def pending_tokens(self, t: float) -> int:
        """Work still owed: queued and running prompts, hand-offs, tokens left to generate."""
        left = self.left_sum - self.batch * self.steps_done(t)
        return self.wait_tokens + self.inflight_tokens + self.handoff_tokens + max(left, 0)

    @property
    def queue_tokens(self) -> int:
        """Prompt tokens not yet prefilled (queued or in the running pass)."""
        return self.wait_tokens + self.inflight_prompt_tokens

    def kv_free(self) -> int:
        return self.kv_cap - self.kv_used

    @property
    def idle(self) -> bool:
        return not (
            self.in_step or self.waiting or self.handoff or self.ready or self.batch
        ) and not (self.kv_used or self.kv_incoming)

    def stop_billing_if_drained(self, t: float) -> None:
        if self.role is Role.OFF and self.bill_start is not None and self.idle:
            self.billed_s += max(t, self.paused_until) - self.bill_start
            self.bill_start = None


@dataclass
class RequestLog:
    """Per-request outcome arrays (NaN where it did not happen)."""

    first_token_s: FloatArray
    finish_s: FloatArray
    max_gap_s: FloatArray
    tokens_out: IntArray
    prefill_inst: IntArray
    decode_inst: IntArray
    dropped: np.ndarray
    kv_transfer_s: FloatArray

    @classmethod
    def empty(cls, n: int) -> RequestLog:
        return cls(
            np.full(n, np.nan),
            np.full(n, np.nan),
            np.zeros(n),
            np.zeros(n, _I64),
            np.full(n, -1, _I64),
            np.full(n, -1, _I64),
            np.zeros(n, bool),
            np.zeros(n),
        )


class Simulator:
    def __init__(
        self,
        fleet: SimFleet,
        trace: Trace,
        policy: Policy,
        model: PerfModel | None = None,
        config: SimConfig | None = None,
        timers: dict[Deployment, StepTimer] | None = None,
    ) -> None:
        self.fleet = fleet
        self.trace = trace
        self.policy = policy
        self.model = model or PerfModel()
        self.config = config or SimConfig()
        self.timers = timers if timers is not None else {}
        self.instances: list[Instance] = []
        for idx, (node, group) in enumerate(fleet.instance_slots()):
            dep = fleet.deployment(group)
            timer = self.timers.get(dep)
            if timer is None:
                timer = self.timers[dep] = StepTimer(self.model, dep)
            cap = self.model.kv_capacity_tokens(dep, self.config.kv_reserve_fraction)
            self.instances.append(Instance(idx, node, group, dep, timer, cap))
        self.kv_bytes_per_token = self.model.kv_bytes_per_token(self.instances[0].dep)
        self.max_kv_cap = max(i.kv_cap for i in self.instances)
        self.prompt = trace.prompt_tokens
        self.output = trace.output_tokens
        self.log = RequestLog.empty(len(trace))
        self.moves: list[Move] = []
        self.efficiency: list[tuple[float, float]] = []
        self.now = 0.0
        self.next_arrival = 0
        self.arrival_stop = len(trace)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._actions: dict[int, Callable[[float], None]] = {}
        self._seq = 0
        self.events = 0
        self.horizon_s = trace.duration_s + self.config.drain_s

    # ----- event plumbing -------------------------------------------------------------------
    def _push(self, t: float, ev: Event, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, int(ev), a, b))

    def start(self) -> None:
        self.policy.setup(self)
        if self.policy.tick_s:
            self._push(self.policy.tick_s, Event.TICK, 0)

    def run(self) -> Simulator:
        self.start()
        self.run_until(math.inf)
        self.finish()
        return self

    def run_until(self, until_s: float) -> None:
        """Process events and arrivals (up to ``arrival_stop``) with time <= ``until_s``."""
        arrival = self.trace.arrival_s
        heap = self._heap
        limit = min(until_s, self.horizon_s)
        while True:
            na = arrival[self.next_arrival] if self.next_arrival < self.arrival_stop else math.inf
            te = heap[0][0] if heap else math.inf
            if min(na, te) > limit:
                break
            self.events += 1
            if na <= te:
                self.now = float(na)
                req = self.next_arrival
                self.next_arrival += 1
                self._arrive(req, self.now)
                continue
            t, _, ev, a, b = heapq.heappop(heap)
            self.now = t
            if ev == Event.STEP_END:
                inst = self.instances[a]
                if inst.version == b:
                    self._step_end(inst, t)
            elif ev == Event.KV_DONE:
                self._kv_done(a, b, t)
            elif ev == Event.RESUME:
                self.kick(self.instances[a], t)
            elif ev == Event.ACTION:
                self._actions.pop(a)(t)
            elif ev == Event.TICK:
                self.policy.on_tick(self, t)
                if self.policy.tick_s and (self.next_arrival < self.arrival_stop or self._busy()):
                    self._push(t + self.policy.tick_s, Event.TICK, 0)

    def _busy(self) -> bool:
        return any(e[2] != Event.TICK for e in self._heap)

    def schedule(self, t: float, action: Callable[[float], None]) -> None:
        """Run ``action(t)`` at simulated time ``t`` (a control step that takes effect later)."""
        self._seq += 1
        self._actions[self._seq] = action
        self._push(t, Event.ACTION, self._seq)

    def finish(self) -> None:
        """Whatever did not finish by the horizon counts as dropped; billing closes."""
        unfinished = np.isnan(self.log.finish_s)
        self.log.dropped |= unfinished
        end = max(self.trace.duration_s, float(np.nanmax(self.log.finish_s, initial=0.0)))
        for inst in self.instances:
            if inst.bill_start is not None:
                inst.billed_s += max(end - inst.bill_start, 0.0)
                inst.bill_start = None

    # ----- requests -------------------------------------------------------------------------
    def _arrive(self, req: int, t: float) -> None:
        need = int(self.prompt[req] + self.output[req])
        if need > self.max_kv_cap:
            self.log.dropped[req] = True
            return
        inst = self.policy.route(self, req, t)
        if inst is None or need > inst.kv_cap:
            self.log.dropped[req] = True
            return
        inst.waiting.append(req)
        inst.wait_tokens += int(self.prompt[req])
        self.log.prefill_inst[req] = inst.idx
        self.kick(inst, t)

    def kick(self, inst: Instance, t: float) -> None:
        """New work for ``inst``: start an iteration now, or cut the current decode run short."""
        if inst.in_step:
            if inst.step_prefills or len(inst.step_cum) <= 1:
                return
            j = int(np.searchsorted(inst.step_cum, t - inst.step_start, side="left")) + 1
            if j >= len(inst.step_cum):
                return
            inst.step_cum = inst.step_cum[:j]
            inst.version += 1
            self._push(
                inst.step_start + float(inst.step_cum[-1]), Event.STEP_END, inst.idx, inst.version
            )
            return
        if t < inst.paused_until:
            self._push(inst.paused_until, Event.RESUME, inst.idx)
            return
        self._start_iteration(inst, t)

    def pause(self, inst: Instance, t: float, seconds: float) -> None:
        """A move takes the instance away for ``seconds`` from its next step boundary."""
        inst.paused_until = max(inst.paused_until, t + seconds)
        self.kick(inst, t)

    def _start_iteration(self, inst: Instance, t: float) -> None:
        if inst.ready:
            self._join(inst, inst.ready)
            inst.ready = []
        self._admit_handoffs(inst, t)
        prefills = self._admit_prompts(inst)
        batch = inst.batch
        if prefills:
            dt = inst.timer.prefill_s([int(self.prompt[r]) for r, _ in prefills])
            if batch:
                dt += inst.timer.decode_step_s(batch, int(inst.run_ctx.sum()))
            inst.step_prefills = prefills
            inst.inflight_prompt_tokens = sum(int(self.prompt[r]) for r, _ in prefills)
            inst.inflight_tokens = inst.inflight_prompt_tokens + sum(
                0 if h else int(self.output[r]) - 1 for r, h in prefills
            )
            cum = np.array([dt])
        elif batch:
            k = int(inst.run_left.min())
            times = inst.timer.decode_run_s(batch, int(inst.run_ctx.sum()), k)
            cum = np.cumsum(times)
            inst.step_prefills = []
        else:
            inst.stop_billing_if_drained(t)
            return
        inst.in_step = True
        inst.step_start = t
        inst.step_cum = cum
        inst.version += 1
        self._push(t + float(cum[-1]), Event.STEP_END, inst.idx, inst.version)

    def _admit_prompts(self, inst: Instance) -> list[tuple[int, bool]]:
        admitted: list[tuple[int, bool]] = []
        tokens = 0
        handoff = inst.role is Role.PREFILL
        room = self.config.max_batch - inst.batch
        while inst.waiting and len(admitted) < room:
            req = inst.waiting[0]
            p = int(self.prompt[req])
            need = p + 1 if handoff else p + int(self.output[req])
            if need > inst.kv_free() or (
                admitted and tokens + p > self.config.prefill_token_budget
            ):
                break
            inst.waiting.popleft()
            inst.wait_tokens -= p
            inst.kv_used += need
            tokens += p
            admitted.append((req, handoff))
        return admitted

    def _admit_handoffs(self, inst: Instance, t: float) -> None:
        while inst.handoff:
            req = inst.handoff[0]
            need = int(self.prompt[req] + self.output[req])
            if need > inst.kv_free() or inst.batch + inst.kv_incoming >= self.config.max_batch:
                return
            inst.handoff.popleft()
            inst.handoff_tokens -= int(self.output[req]) - 1
            inst.kv_used += need
            inst.kv_incoming += 1
            src = self.instances[int(self.log.prefill_inst[req])]
            self.log.kv_transfer_s[req] = self.transfer_s(src, inst, int(self.prompt[req]) + 1)
            self._push(
                t + float(self.log.kv_transfer_s[req]),
                Event.KV_DONE,
                req,
                inst.idx,
            )

    def transfer_s(self, src: Instance, dst: Instance, tokens: int) -> float:
        """KV bytes over NVLink (same node) or the NICs (across nodes), TP shards in parallel."""
        if src.idx == dst.idx:
            return 0.0
        lanes = min(src.group.tp, dst.group.tp)
        if src.node == dst.node:
            gbps = min(src.dep.gpu.interconnect_gbps, dst.dep.gpu.interconnect_gbps) / 2
        else:
            gbps = self.fleet.internode_gbps_per_gpu
        return _KV_LATENCY_S + tokens * self.kv_bytes_per_token / (lanes * gbps * 1e9)

    def _kv_done(self, req: int, dst_idx: int, t: float) -> None:
        src = self.instances[int(self.log.prefill_inst[req])]
        src.kv_used -= int(self.prompt[req]) + 1
        dst = self.instances[dst_idx]
        dst.kv_incoming -= 1
        dst.ready.append(req)
        self.kick(dst, t)
        if src.waiting:
            self.kick(src, t)
        src.stop_billing_if_drained(t)

    def _join(self, inst: Instance, reqs: list[int]) -> None:
        ids = np.asarray(reqs, dtype=_I64)
        left = self.output[ids] - 1
        inst.run_ids = np.concatenate([inst.run_ids, ids])
        inst.run_left = np.concatenate([inst.run_left, left])
        inst.run_ctx = np.concatenate([inst.run_ctx, self.prompt[ids] + 1])
        inst.run_last = np.concatenate([inst.run_last, self.log.first_token_s[ids]])
        inst.run_gap = np.concatenate([inst.run_gap, np.zeros(len(ids))])
        inst.left_sum += int(left.sum())
        self.log.decode_inst[ids] = inst.idx

    def _step_end(self, inst: Instance, t: float) -> None:
        cum = inst.step_cum
        k = len(cum)
        inst.busy_s += float(cum[-1])
        inst.in_step = False
        batch = inst.batch
        if batch:
            first = inst.step_start + float(cum[0])
            gaps = np.maximum(first - inst.run_last, inst.run_gap)
            if k > 1:
                gaps = np.maximum(gaps, float(np.max(np.diff(cum))))
            inst.run_gap = gaps
            inst.run_last = np.full(batch, t)
            inst.run_left -= k
            inst.run_ctx += k
            inst.left_sum -= batch * k
            inst.decode_tokens_done += batch * k
            self.log.tokens_out[inst.run_ids] += k
            done = inst.run_left <= 0
            if done.any():
                self._retire(inst, done, t)
        prefills = inst.step_prefills
        inst.step_prefills = []
        inst.inflight_prompt_tokens = inst.inflight_tokens = 0
        local: list[int] = []
        for req, handoff in prefills:
            inst.prefill_tokens_done += int(self.prompt[req])
            self.log.first_token_s[req] = t
            self.log.tokens_out[req] += 1
            if self.output[req] == 1:
                inst.kv_used -= int(self.prompt[req]) + (1 if handoff else int(self.output[req]))
                self.log.finish_s[req] = t
            elif handoff:
                dst = self.policy.pick_decode(self, req, inst, t)
                if dst is inst:
                    inst.kv_used += int(self.output[req]) - 1
                    local.append(req)
                else:
                    dst.handoff.append(req)
                    dst.handoff_tokens += int(self.output[req]) - 1
                    self.kick(dst, t)
            else:
                local.append(req)
        if local:
            self._join(inst, local)
        if inst.paused_until > t:
            self._push(inst.paused_until, Event.RESUME, inst.idx)
        else:
            self._start_iteration(inst, t)

    def _retire(self, inst: Instance, done: np.ndarray, t: float) -> None:
        ids = inst.run_ids[done]
        self.log.finish_s[ids] = t
        self.log.max_gap_s[ids] = inst.run_gap[done]
        inst.kv_used -= int((self.prompt[ids] + self.output[ids]).sum())
        keep = ~done
        inst.run_ids = inst.run_ids[keep]
        inst.run_left = inst.run_left[keep]
        inst.run_ctx = inst.run_ctx[keep]
        inst.run_last = inst.run_last[keep]
        inst.run_gap = inst.run_gap[keep]

    # ----- control --------------------------------------------------------------------------
    def set_role(self, inst: Instance, role: Role, t: float, kind: str, cost_s: float) -> None:
        """Give ``inst`` a new role; it is out of service for ``cost_s`` (billed meanwhile)."""
        before = inst.role
        inst.role = role
        self.moves.append(Move(t, inst.idx, inst.gpu, before.value, role.value, kind, cost_s))
        if role is not Role.OFF and inst.bill_start is None:
            inst.bill_start = t
        if cost_s > 0:
            self.pause(inst, t, cost_s)
        elif role is Role.OFF:
            inst.stop_billing_if_drained(t)

    def snapshot(self) -> Simulator:
        """A deep copy sharing the immutable parts (trace, fleet, model, timers)."""
        memo: dict[int, object] = {
            id(x): x
            for x in (self.fleet, self.trace, self.model, self.prompt, self.output, self.timers)
        }
        for inst in self.instances:
            memo[id(inst.timer)] = inst.timer
            memo[id(inst.dep)] = inst.dep
            memo[id(inst.group)] = inst.group
        return copy.deepcopy(self, memo)
