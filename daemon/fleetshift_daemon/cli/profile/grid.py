"""Which (prompt size, concurrency) points a profile measures, bounded by what the worker holds.

Seeds 000 and 004 ask for concurrency varied geometrically (1, 4, 16, 64, 256) and prompts from
128 to 8k tokens. A worker cannot run every point: a prompt longer than the model's context, or a
batch whose sessions cannot all hold their KV at once, would measure queueing or preemption, not
the step. So the grid keeps only the points that fit, and says which it dropped and why, rather
than timing something else under the same label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CONCURRENCY: tuple[int, ...] = (1, 4, 16, 64, 256)
DEFAULT_PROMPT_SIZES: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class WorkerLimits:
    """What bounds a point: the worker's KV pool, its running-session limit, the context."""

    kv_tokens: int  # KV blocks x block size the worker reports
    kv_block_size: int
    max_running: int  # sessions the worker runs at once; more would queue
    max_context: int  # the model's positions (config.json max_position_embeddings)


@dataclass(frozen=True)
class Point:
    prompt_size: int
    batch_size: int
    token_size: int

    @property
    def tokens(self) -> int:
        """Prompt and generated tokens the whole batch holds at its end."""
        return self.batch_size * (self.prompt_size + self.token_size)


@dataclass(frozen=True)
class Grid:
    points: tuple[Point, ...]
    skipped: tuple[str, ...]  # one line per point left out, naming the bound that excluded it


def geometric(limit: int, base: Sequence[int] = DEFAULT_CONCURRENCY) -> tuple[int, ...]:
    """The geometric concurrency ladder up to ``limit``, plus ``limit`` itself when it falls
    between two rungs, so the largest batch the worker can hold is always measured."""
    if limit < 1:
        raise ValueError("max concurrency must be >= 1")
    rungs = [c for c in base if c <= limit]
    if not rungs or rungs[-1] < limit:
        rungs.append(limit)
    return tuple(rungs)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def misfit(limits: WorkerLimits, point: Point) -> str:
    """Why the worker cannot run ``point`` as one batch ("" when it can)."""
    if point.prompt_size + point.token_size > limits.max_context:
        return (
            f"prompt {point.prompt_size}: prompt + {point.token_size} output tokens exceeds the "
            f"model's {limits.max_context} positions"
        )
    need = point.batch_size * _blocks(point.prompt_size + point.token_size, limits.kv_block_size)
    kv_blocks = limits.kv_tokens // limits.kv_block_size
    if need > kv_blocks:
        return (
            f"prompt {point.prompt_size} x batch {point.batch_size} x {point.token_size} tokens: "
            f"needs {need} KV blocks, the worker has {kv_blocks}"
        )
    return ""


def plan_grid(
    limits: WorkerLimits,
    prompt_sizes: Sequence[int],
    max_concurrency: int,
    token_size: int,
) -> Grid:
    """Every (prompt, concurrency) point that fits the worker, in measuring order."""
    if token_size < 2:
        raise ValueError("token size must be >= 2: a decode step is timed between two tokens")
    ladder = geometric(min(max_concurrency, limits.max_running))
    points: list[Point] = []
    skipped: list[str] = []
    if max_concurrency > limits.max_running:
        skipped.append(
            f"concurrency above {limits.max_running}: the worker runs at most "
            f"{limits.max_running} sessions at once (more would measure its queue)"
        )
    for prompt in sorted(set(prompt_sizes)):
        for batch in ladder:
            point = Point(prompt, batch, token_size)
            why = misfit(limits, point)
            if why:
                skipped.append(why)
                break  # larger batches need more still
            points.append(point)
    return Grid(tuple(points), tuple(skipped))
