"""Sends the workload through the gateway with the official ``openai`` client, each request
at its time, streamed, and records what every client saw (chunks and when they came)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fleetshift_daemon.demo.workload import DemoRequest, Workload

TEMPERATURE, TOP_P = 0.8, 0.95  # seeded sampling: a rerun of the same request is bit-equal


@dataclass
class StreamRecord:
    request: DemoRequest
    sent_at: float = 0.0  # seconds from the replay's start
    first_at: float | None = None
    chunk_at: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage_tokens: int | None = None
    response_id: str = ""
    error: str = ""
    done: bool = False

    @property
    def ended_at(self) -> float:
        return self.chunk_at[-1] if self.chunk_at else self.sent_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_at, self.chunk_at[1:], strict=False)]


def openai_client(base_url: str) -> Any:
    """The official client; the demo says how to get it when it is missing."""
    try:
        import openai
    except ImportError as err:  # pragma: no cover - dev installs it
        raise SystemExit(
            "the demo drives the gateway with the official openai client: "
            "pip install openai (./scripts/demo installs the dev extra, which has it)"
        ) from err
    return openai.AsyncOpenAI(
        base_url=base_url, api_key="fleetshift-demo", max_retries=0, timeout=900
    )


async def replay(
    client: Any, model: str, workload: Workload, records: list[StreamRecord], started: float
) -> None:
    """Send every request at its time (``started`` is the replay's ``time.monotonic()`` zero),
    and wait for every stream to end."""
    tasks = []
    for req in workload.requests:
        delay = started + req.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        record = StreamRecord(req, sent_at=time.monotonic() - started)
        records.append(record)
        tasks.append(asyncio.create_task(send_one(client, model, record, started)))
    await asyncio.gather(*tasks)


async def send_one(client: Any, model: str, record: StreamRecord, started: float) -> None:
    """One streamed request, recorded as the client sees it; an error is recorded, not raised."""
    req = record.request
    try:
        stream = await client.completions.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            seed=req.seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            record.response_id = chunk.id
            if chunk.usage is not None:
                record.usage_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            now = time.monotonic() - started
            if record.first_at is None:
                record.first_at = now
            record.chunk_at.append(now)
            record.texts.append(chunk.choices[0].text)
            record.finish_reason = chunk.choices[0].finish_reason or record.finish_reason
    except Exception as err:
        record.error = f"{type(err).__name__}: {err}"
    finally:
        record.done = True
