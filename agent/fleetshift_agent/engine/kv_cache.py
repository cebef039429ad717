"""The paged KV cache: one preallocated pool per layer, handed out in fixed-size blocks.

Preallocating means the memory a worker needs is known at start and reported as capacity;
blocks mean a session grows without copying and its cache can be exported as exactly the
tokens it holds.
"""

from __future__ import annotations

import torch

from fleetshift_common.errors import ResourceExhausted


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> None:
        """Extends a block table in place so it covers ``tokens`` tokens."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            raise ResourceExhausted(
                f"KV cache needs {need} more blocks, {len(self._free)} free", field="kv_blocks"
            )
        table.extend(self._free.pop() for _ in range(need))

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Flat pool indices of positions [start, stop) of a session."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(self.k[0].device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = (-1, *self.k[layer].shape[2:])
        self.k[layer].view(flat).index_copy_(0, slots, k)
        self.v[layer].view(flat).index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = (-1, *self.k[layer].shape[2:])
        return self.k[layer].view(flat)[slots], self.v[layer].view(flat)[slots]

    def export(
        self, table: list[int], tokens: int, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [start, tokens) of a session as [layers, n, kv_heads, head_dim], K and V."""
        slots = self.slots(table, start, tokens)
        ks, vs = zip(*(self.read(i, slots) for i in range(len(self.k))), strict=True)
        return torch.stack(ks).cpu(), torch.stack(vs).cpu()

    def load(self, table: list[int], k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Writes K/V for positions [start, start + n) of a session (the table must cover them)."""
        slots = self.slots(table, start, start + k.shape[1])
        device, dtype = self.k[0].device, self.k[0].dtype
        for i in range(len(self.k)):
            self.write(i, slots, k[i].to(device, dtype), v[i].to(device, dtype))
