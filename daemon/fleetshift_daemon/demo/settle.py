"""After the replay: keep the decode-heavy mix flowing and wait for the figure to come back.

The replay ends while the planner may still be answering the turn of the mix (a start takes
10-35 s on this CPU, and a plan waits for the one before it). Stopping the traffic then would
leave the daemon's window draining (its rate falls with no request behind it), and whatever
the figure did next would say nothing about the planner. So the demo keeps sending the
second half's request shapes at a low steady rate and watches the daemon's own figure until
it has *recovered*: at or above the threshold for ``HOLD_SAMPLES`` polls in a row with no
step of any operation in flight, after having been below it. A bound (``--settle-s``) ends
the wait; the summary then says plainly that it did not recover, and why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleetshift_common.lifecycle import wait_or_timeout
from fleetshift_daemon.demo.replay import StreamRecord, send_one
from fleetshift_daemon.demo.watch import HOLD_SAMPLES, Sample, Step, recovered_at
from fleetshift_daemon.demo.workload import DECODE_HEAVY, SETTLING, DemoRequest, Workload

FIRST_INDEX = 200_000  # the settling requests' indices, apart from the replay's and carriers'


@dataclass(frozen=True)
class Outcome:
    """What the summary says about the recovery: when (and at what figure) or why not."""

    recovered: float | None  # replay seconds
    figure: float | None  # the daemon's figure at the end of the wait
    why_not: str = ""

    def line(self, threshold: float) -> str:
        if self.recovered is not None:
            return (
                f"recovered: yes, at {self.recovered:.1f} s (efficiency {self.figure:.2f} >= "
                f"{threshold:.2f} with no move in flight)"
            )
        return f"recovered: no -- {self.why_not}"


def outcome(
    samples: Sequence[Sample],
    steps: Sequence[Step],
    threshold: float,
    bound_s: float,
    still_wanted: str,
    was_back: float | None = None,
) -> Outcome:
    """The recovery as the samples show it at the very end (a figure that came back and fell
    again before the demo stopped reading has not recovered)."""
    figure = next((s.efficiency for s in reversed(samples) if s.efficiency is not None), None)
    back = recovered_at(samples, threshold)
    if back is not None:
        return Outcome(back, figure)
    why = why_not(samples, steps, threshold, bound_s, still_wanted)
    if was_back is not None:
        why = f"{why} (it was back at {was_back:.1f} s, then fell again)"
    return Outcome(None, figure, why)


def why_not(
    samples: Sequence[Sample],
    steps: Sequence[Step],
    threshold: float,
    bound_s: float,
    still_wanted: str,
) -> str:
    """Why the figure is not back when the wait ended, from what the demo read."""
    effs = [s.efficiency for s in samples if s.efficiency is not None]
    if not effs:
        return "the daemon published no efficiency figure"
    if min(effs) >= threshold:
        return f"the figure never fell below {threshold:.2f}, so there was nothing to recover"
    running = [s for s in steps if s.state in ("pending", "running")]
    head = f"not back within --settle-s {bound_s:.0f} s (at the end {effs[-1]:.2f})"
    if running:
        kinds = ", ".join(sorted({s.kind for s in running}))
        ops = ", ".join(sorted({s.op_id for s in running}))
        return f"{head}: {len(running)} step(s) still in flight ({kinds}; {ops})"
    if effs[-1] >= threshold:
        return f"{head}: back over the threshold for fewer than {HOLD_SAMPLES} polls"
    return f"{head}: nothing in flight; {still_wanted}"


def settling_request(workload: Workload, i: int, at_s: float) -> DemoRequest:
    """The ``i``-th settling request: the second half's shapes, cycled, with a fresh seed
    and index."""
    shapes = workload.in_phase(DECODE_HEAVY) or workload.requests
    shape = shapes[i % len(shapes)]
    index = FIRST_INDEX + i
    return DemoRequest(index, at_s, shape.prompt, shape.max_tokens, 1000 + index, SETTLING)


async def steady(
    client: Any,
    model: str,
    workload: Workload,
    rate_per_s: float,
    records: list[StreamRecord],
    started: float,
    stop: asyncio.Event,
) -> None:
    """Send the second half's shapes every ``1 / rate_per_s`` seconds until ``stop``; then
    wait for the streams still open."""
    tasks: list[asyncio.Task[None]] = []
    if rate_per_s <= 0:
        return
    i = 0
    while not stop.is_set():
        now = time.monotonic() - started
        record = StreamRecord(settling_request(workload, i, now), sent_at=now)
        records.append(record)
        tasks.append(asyncio.create_task(send_one(client, model, record, started)))
        i += 1
        await wait_or_timeout(stop, 1.0 / rate_per_s)
    await asyncio.gather(*tasks)
