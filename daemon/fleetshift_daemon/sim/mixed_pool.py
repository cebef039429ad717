"""Splitwise's own scheduling of a split fleet: fixed pools that lend machines when overloaded.

Splitwise's designed fleets (Splitwise-HA, -HH) are not run with rigid pools: its simulator
schedules them with a *mixed pool* (``MixedPoolScheduler`` in splitwise-sim, the scheduler
its cost-optimal runs use; section IV-C of the paper). Each request goes to the prompt machine
with the fewest pending prompt tokens and to the token machine with the most free KV memory,
but

* when the best prompt machine already has a queue longer than ``prompt_queue_tokens``
  (8,192 in Splitwise's configuration), a token machine takes the prompt and runs it
  colocated (prefill and decode on the same machine); when every queue is long, the
  machine with the shortest prompt queue of either pool takes it; and
* when the best token machine has no KV room left for the request, a prompt machine decodes
  it (the one with the most free KV, the prompt's own machine first, so no transfer is paid).

So a Splitwise design with one token machine still passes a load one token machine alone
cannot decode: its prompt machines take the decode overflow. Comparing our simulator with
Splitwise's on designs scheduled as ``policies.FixedSplit`` (pools never lend) compares two
different designs, not two simulators; this policy is the Splitwise design.

The pools themselves stay fixed at deploy time (``FixedSplit.setup``): nothing here changes an
instance's role, only where a request's two phases run.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetshift_daemon.sim.engine import Instance, Role, Simulator
from fleetshift_daemon.sim.policies import DEPLOY_WINDOW_S, FixedSplit, fits

PROMPT_QUEUE_TOKENS = 8192  # splitwise-sim's mixed_pool.yml: prompt_max_pending_batch_tokens


class MixedPoolSplit(FixedSplit):
    """``FixedSplit``'s pools, scheduled as Splitwise's mixed-pool scheduler does."""

    name = "mixed-pool"

    def __init__(
        self,
        prefill: int,
        prompt_queue_tokens: int = PROMPT_QUEUE_TOKENS,
        deploy_window_s: float = DEPLOY_WINDOW_S,
    ) -> None:
        super().__init__(prefill, deploy_window_s)
        self.prompt_queue_tokens = prompt_queue_tokens

    def route(self, sim: Simulator, req: int, t: float) -> Instance | None:
        """The prompt machine with the shortest prompt queue, unless that queue is long; then
        the token machine with the shortest one, unless it is long too; then, as Splitwise
        falls back to mixed batching, whichever machine has the shortest prompt queue."""
        p = int(sim.prompt[req])
        for role in (Role.PREFILL, Role.DECODE):
            best = _least(sim, req, (role,), lambda i: i.queue_tokens)
            if best is not None and not self._queue_long(best, p):
                return best
        return _least(sim, req, (Role.PREFILL, Role.DECODE), lambda i: i.queue_tokens)

    def pick_decode(self, sim: Simulator, req: int, src: Instance, t: float) -> Instance:
        """The token machine with the most free KV, else a prompt machine with room."""
        token = _most_free(sim, Role.DECODE)
        if token is not None and _has_room(sim, token, req):
            return token
        if src.kv_free() >= int(sim.output[req]) - 1:
            return src  # decodes where its KV already is: no transfer
        other = _most_free(sim, Role.PREFILL)
        if other is not None and _has_room(sim, other, req):
            return other
        return token or src

    def _queue_long(self, inst: Instance, prompt_tokens: int) -> bool:
        return bool(inst.waiting) and inst.queue_tokens + prompt_tokens > self.prompt_queue_tokens


def _least(
    sim: Simulator, req: int, roles: tuple[Role, ...], key: Callable[[Instance], float]
) -> Instance | None:
    pool = [i for i in sim.instances if i.role in roles and fits(sim, i, req)]
    return min(pool, key=key) if pool else None


def _most_free(sim: Simulator, role: Role) -> Instance | None:
    pool = [i for i in sim.instances if i.role is role]
    return max(pool, key=lambda i: i.kv_free()) if pool else None


def _has_room(sim: Simulator, inst: Instance, req: int) -> bool:
    """Room for the whole sequence and no backlog of hand-offs already waiting for room."""
    need = int(sim.prompt[req] + sim.output[req])
    return not inst.handoff and need <= inst.kv_free()
