"""FleetShift's disk connector copies whole KV blocks, not token by token (no vLLM needed).

The connector runs inside vLLM's interpreter, so its copy helpers are source text
(``server.BLOCK_COPY_SOURCE``); here they run under torch against upstream's per-token
indexing (``layer[slot // N, :, slot % N]``), on the shapes a store and a load produce: a
context's whole blocks in any order of the block table, and, for anything else, upstream's
own indexing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fleetshift_agent.vllm_worker.server import BLOCK_COPY_SOURCE

N = 16  # block size


@pytest.fixture(scope="module")
def copy() -> SimpleNamespace:
    scope: dict[str, object] = {"torch": torch}
    exec(compile(BLOCK_COPY_SOURCE, "fleetshift_vllm_disk", "exec"), scope)
    return SimpleNamespace(**scope)


def slots_of(blocks: list[int], tokens: int) -> torch.Tensor:
    """make_meta's slot mapping: each block's slots in order, cut to ``tokens``."""
    table = torch.tensor(blocks)
    return (table.view(-1, 1) * N + torch.arange(N)).flatten()[:tokens]


@pytest.mark.parametrize("shape", [(40, 2, N, 8), (40, 3, N, 4, 2)], ids=["4-d", "5-d"])
@pytest.mark.parametrize(
    ("blocks", "tokens"),
    [([7, 3, 30, 12], 4 * N), ([5], N), ([9, 2, 33], 3 * N - 5)],
    ids=["whole blocks", "one block", "partial last block"],
)
def test_block_copies_equal_upstreams_per_token_indexing(
    copy: SimpleNamespace, shape: tuple[int, ...], blocks: list[int], tokens: int
) -> None:
    layer = torch.randn(shape)
    slots = slots_of(blocks, tokens)
    upstream = layer[slots // N, :, slots % N]
    taken = copy.take_tokens(layer, slots, N)
    assert torch.equal(taken, upstream)

    mine, theirs = torch.zeros(shape), torch.zeros(shape)
    copy.put_tokens(mine, slots, N, upstream)
    theirs[slots // N, :, slots % N] = upstream
    assert torch.equal(mine, theirs)  # every slot written, nothing else touched


def test_only_a_mapping_of_whole_ordered_blocks_is_copied_by_block(copy: SimpleNamespace) -> None:
    assert copy._whole_blocks(slots_of([4, 1], 2 * N), N).tolist() == [4, 1]
    assert copy._whole_blocks(slots_of([4, 1], 2 * N - 1), N) is None
    shuffled = slots_of([4, 1], 2 * N).flip(0)
    assert copy._whole_blocks(shuffled, N) is None
    assert copy._whole_blocks(torch.tensor([], dtype=torch.long), N) is None
