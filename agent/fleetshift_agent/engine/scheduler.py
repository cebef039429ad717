"""Continuous batching: which sessions run how many tokens in the next step.

Running sessions go first (a decode is one token, an unfinished prefill continues), then
waiting sessions are admitted while the step's token budget, the running limit and the KV
cache allow. When a running session cannot grow, the most recently admitted one is preempted:
its KV is dropped and it waits to be recomputed, which the engine does bit-exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fleetshift_agent.engine.kv_cache import PagedKVCache
from fleetshift_agent.engine.session import Session, SessionState
from fleetshift_common.errors import ResourceExhausted


@dataclass(frozen=True)
class Slice:
    session: Session
    tokens: int  # how many pending tokens run this step

    @property
    def end(self) -> int:
        """The session's position after this step."""
        return self.session.cached + self.tokens


class Scheduler:
    def __init__(self, kv: PagedKVCache, *, max_running: int, max_step_tokens: int) -> None:
        self.kv = kv
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Session] = deque()
        self.running: list[Session] = []
        self.preemptions = 0

    def enqueue(self, session: Session, *, front: bool = False) -> None:
        session.state = SessionState.WAITING
        if front:
            self.waiting.appendleft(session)
        else:
            self.waiting.append(session)

    def remove(self, session: Session) -> None:
        if session in self.running:
            self.running.remove(session)
        if session in self.waiting:
            self.waiting.remove(session)
        self.kv.release(session.blocks)
        session.cached = 0

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def plan(self) -> list[Slice]:
        budget = self.max_step_tokens
        planned: list[Slice] = []
        index = 0
        while index < len(self.running) and budget > 0:
            s = self.running[index]
            n = min(s.pending, budget)
            if not self._grow_or_preempt(s, n):
                continue  # s itself was preempted; the list shrank under index
            planned.append(Slice(s, n))
            budget -= n
            index += 1
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            s = self.waiting[0]
            n = min(s.pending, budget)
            try:
                self.kv.grow(s.blocks, s.cached + n)
            except ResourceExhausted:
                break
            self.waiting.popleft()
            s.state = SessionState.RUNNING
            self.running.append(s)
            planned.append(Slice(s, n))
            budget -= n
        return planned

    def _grow_or_preempt(self, s: Session, n: int) -> bool:
        while True:
            try:
                self.kv.grow(s.blocks, s.cached + n)
                return True
            except ResourceExhausted:
                victim = self.running[-1]
                self.running.pop()
                self.kv.release(victim.blocks)
                victim.cached = 0
                self.enqueue(victim, front=True)
                self.preemptions += 1
                if victim is s:
                    return False
