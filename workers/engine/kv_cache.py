"""Paged KV cache: per-layer pools indexed by block id, and the block manager.

Pool of one layer: `[num_blocks, 2, kv_heads_local, block_size, head_dim]` (2: key, value).
Every PP stage allocates its pools for its own layers, indexed by the same block ids that
stage 0's block manager hands out; a TP rank holds its own slice of the KV heads.
"""

from __future__ import annotations

import torch


class BlockManager:
    """Free list plus reference counts (a block is free again when its count drops to 0)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        free, refs = self._free, self._refs
        out = free[len(free) - n:][::-1] if n else []
        del free[len(free) - n:]
        for b in out:
            refs[b] = 1
        return out

    def retain(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        refs, free = self._refs, self._free
        for b in blocks:
            r = refs[b]
            if r <= 0:
                raise ValueError(f"block {b} released twice")
            refs[b] = r - 1
            if r == 1:
                free.append(b)

    def take(self, blocks: list[int]) -> None:
        """Mark specific free blocks as used (a decode engine receiving KV into chosen blocks)."""
        want = set(blocks)
        if len(want) != len(blocks) or any(self._refs[b] for b in blocks):
            raise ValueError("blocks to take must be distinct and free")
        self._free = [b for b in self._free if b not in want]
        for b in blocks:
            self._refs[b] = 1


class KVPool:
    """The KV tensors of one process: one pool per local layer."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        self.block_size = block_size
        self.layers = [torch.zeros(num_blocks, 2, kv_heads, block_size, head_dim, dtype=dtype, device=device)
                       for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] into flat slots (block * block_size + offset): [T]."""
        pool = self.layers[layer]
        blocks, offs = slots // self.block_size, slots % self.block_size
        pool[blocks, 0, :, offs] = k
        pool[blocks, 1, :, offs] = v

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one sequence's first `length` positions: [kv_heads, length, head_dim] each."""
        kv = self.layers[layer][block_table]            # [nb, 2, kvh, bs, hd]
        nb, _, kvh, bs, hd = kv.shape
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(kvh, nb * bs, hd)[:, :length]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(kvh, nb * bs, hd)[:, :length]
        return k, v
