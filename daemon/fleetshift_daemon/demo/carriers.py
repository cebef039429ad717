"""Long streams kept open through every move, so each move finds live sessions to carry.

On this CPU the demo model's streams last about a second, while a move's target takes 10-35 s
to start. A moving worker keeps serving new sessions until its target has started, then takes
no new one and carries what is open on it at that moment; with the replay's short streams
alone, a move found none open in most runs, and the short demo's moves finish after its
replay has ended. So while a warm or cold move of a worker that decodes (decode or mixed
role) is pending or running, the demo keeps ``per_worker`` long streams open for each
worker that decodes, up to ``cap``: decode-heavy requests like the replay's second half (a short
prompt, an output that fills the model's context), sent through the gateway like every
other request and sent again as each ends. Where they run is the router's choice, as for
any request. They are recorded and checked like the replay's streams: the count check for
each, and the rerun on an unmoved worker, token for token, for those open when a move
switched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as opb
from fleetshift.v1 import operations_pb2_grpc as ogrpc
from fleetshift_common.lifecycle import wait_or_timeout
from fleetshift_daemon.demo.replay import StreamRecord, send_one
from fleetshift_daemon.demo.watch import FleetWatch
from fleetshift_daemon.demo.workload import CARRIER, FIRST_PLAIN_TOKEN, DemoRequest
from fleetshift_daemon.localfleet import NodeSpec

RELOCATIONS = ("warm move", "cold move")  # the steps that carry sessions to another worker
DECODING_ROLES = (fpb.WORKER_ROLE_DECODE, fpb.WORKER_ROLE_MIXED)
FIRST_INDEX = 100_000  # carriers' request indices, apart from the replay's
PROMPT_TOKENS = 16


@dataclass
class Carriers:
    client: Any  # openai.AsyncOpenAI
    model: str
    watch: FleetWatch
    started: float  # the replay's time.monotonic() zero
    context_tokens: int
    vocab_size: int
    per_worker: int = 3
    cap: int = 12
    records: list[StreamRecord] = field(default_factory=list)
    forced: bool = False  # keep them open with no move under way (before an operator move)
    _running: set[asyncio.Task[None]] = field(default_factory=set)

    def wanted(self) -> int:
        """How many carriers should be open now: none unless a move of a worker that decodes
        is under way (a prefill worker holds a session only while it prefills: long streams
        would only load the CPU)."""
        roles = {w.worker_id: w.role for w in self.watch.workers}
        moving = any(
            s.kind in RELOCATIONS
            and s.state in ("pending", "running")
            and roles.get(s.worker) in DECODING_ROLES
            for s in self.watch.steps.values()
        )
        if not moving and not self.forced:
            return 0
        decoding = sum(
            1
            for w in self.watch.workers
            if w.role in DECODING_ROLES and w.state == fpb.WORKER_STATE_SERVING
        )
        return min(self.cap, self.per_worker * max(1, decoding))

    async def run(self, stop: asyncio.Event) -> None:
        """Top the carriers up every 0.2 s until ``stop``; then wait for the open ones."""
        while not stop.is_set():
            for _ in range(self.wanted() - len(self._running)):
                self._send()
            await wait_or_timeout(stop, 0.2)
        await asyncio.gather(*self._running)

    def _send(self) -> None:
        index = FIRST_INDEX + len(self.records)
        rng = np.random.default_rng(index)
        prompt = rng.integers(FIRST_PLAIN_TOKEN, self.vocab_size, PROMPT_TOKENS)
        now = time.monotonic() - self.started
        request = DemoRequest(
            index=index,
            at_s=now,
            prompt=[int(t) for t in prompt],
            max_tokens=self.context_tokens - PROMPT_TOKENS,
            seed=1000 + index,
            phase=CARRIER,
        )
        record = StreamRecord(request, sent_at=now)
        self.records.append(record)
        task = asyncio.get_running_loop().create_task(
            send_one(self.client, self.model, record, self.started)
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)


TERMINAL = ("done", "failed", "rolled_back", "skipped")


async def operator_move(
    daemon: grpc.aio.Channel,
    carriers: Carriers,
    nodes: Sequence[NodeSpec],
    timeout_s: float = 240.0,
) -> None:
    """Move the worker holding the most open streams to another node, as an operator would
    (``Operations/MoveWorker``), with carriers kept open throughout: the demo's closing move
    when none of the planner's moves carried a session this run (its moves are its own
    choice; a run whose mix it serves well enough makes only starts and role changes, and a
    move whose source the router sends few streams to finds none open).

    The busiest decoding worker is the one the router prefers for the carriers, and it keeps
    taking new sessions while its target starts, so it usually still holds streams when they
    are copied. Usually: the router may send the new carriers to other workers meanwhile (the
    planner's fresh starts are emptier), and on a loaded machine the target's start outlasts
    every stream left on the source; CI saw such a move carry none. So a move that carried
    no session is followed by another, the worker picked afresh, as is a refusal (the
    planner's own moves in flight, no room on a node) every 2 s, until ``timeout_s``."""
    fw = carriers.watch
    carriers.forced = True
    deadline = time.monotonic() + timeout_s
    refused = "no worker held an open stream"
    try:
        while time.monotonic() < deadline:
            worker = await _busiest(fw, deadline - time.monotonic())
            if worker is None:
                break
            for target in _targets(worker, fw.workers, nodes):
                move = opb.MoveWorkerRequest(
                    worker_id=worker.worker_id,
                    target_node=target,
                    reason="the demo: a move while streams run",
                )
                try:
                    op = await ogrpc.OperationsStub(daemon).MoveWorker(move, timeout=30)
                except grpc.aio.AioRpcError as err:
                    refused = f"{target}: {err.details()}"
                    continue
                fw.event(
                    f"OPERATOR MOVE {op.id}: {worker.worker_id} ({len(worker.session_ids)} "
                    f"open stream(s) on it) -> {target}, long streams kept open through it"
                )
                await _finished(fw, op.id, deadline - time.monotonic())
                if _carried(fw, op.id):
                    return
                refused = f"{op.id} found no stream open on {worker.worker_id} at its copy"
                fw.event(f"OPERATOR MOVE {op.id} carried no session: {refused}; moving again")
                break
            await asyncio.sleep(2.0)
        fw.event(f"no operator move within {timeout_s:.0f} s (last refusal: {refused})")
    finally:
        carriers.forced = False


async def _busiest(fw: FleetWatch, timeout_s: float) -> fpb.WorkerStatus | None:
    """The serving decoding worker with the most live sessions, once one has any."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decoding = [
            w
            for w in fw.workers
            if w.role in DECODING_ROLES and w.state == fpb.WORKER_STATE_SERVING and w.session_ids
        ]
        if decoding:
            return max(decoding, key=lambda w: len(w.session_ids))
        await asyncio.sleep(0.5)
    return None


def _targets(
    worker: fpb.WorkerStatus, workers: Sequence[fpb.WorkerStatus], nodes: Sequence[NodeSpec]
) -> list[str]:
    """Other nodes, those of the worker's GPU kind first (a warm move), then the emptiest."""
    kind = {n.name: n.product_name for n in nodes}
    load = {n.name: sum(1 for w in workers if w.node_name == n.name) for n in nodes}
    others = [n.name for n in nodes if n.name != worker.node_name]
    return sorted(others, key=lambda n: (kind[n] != kind.get(worker.node_name), load[n]))


def _carried(fw: FleetWatch, op_id: str) -> int:
    return sum(s.sessions_carried for (op, _), s in fw.steps.items() if op == op_id)


async def _finished(fw: FleetWatch, op_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = [s for (op, _), s in fw.steps.items() if op == op_id]
        if steps and all(s.state in TERMINAL for s in steps):
            return
        await asyncio.sleep(1.0)
    fw.event(f"stopped waiting for {op_id} after {timeout_s:.0f} s")
