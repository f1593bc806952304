"""Prefill-side KV holding: a block pool and the transfers that pin blocks until released.

Used by the mock prefill pipeline and the real one alike. A transfer is held from the end
of its prefill until every consumer rank has sent `release` (the consumer path), the mesh
posts `/kv/release` (the mesh-reclaim path) or its TTL fires (the ttl path). Each path
frees the blocks exactly once; later releases are counted as duplicates and change nothing.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from contract.protocol import FreedTransfer, HeldList, HeldTransfer


class BlockPool:
    """Fixed pool of block ids with a free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> tuple[int, ...] | None:
        if n > len(self._free):
            return None
        out = tuple(self._free[-n:][::-1]) if n else ()
        del self._free[len(self._free) - n:]
        return out

    def release(self, blocks: tuple[int, ...]) -> None:
        self._free.extend(reversed(blocks))


@dataclass(slots=True)
class Held:
    transfer_id: str
    blocks: tuple[int, ...]
    request_id: str
    mesh_id: str
    consumers: int
    created: float
    released_ranks: set[int] = field(default_factory=set)


class TransferHolder:
    def __init__(self, pool: BlockPool | None, ttl_s: float = 120.0,
                 on_free: Callable[[Held, str], None] | None = None, remember: int = 4096) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.pool = pool
        self.ttl_s = ttl_s
        self._held: dict[str, Held] = {}
        self._on_free = on_free
        self.freed_by: Counter[str] = Counter()   # consumer / mesh-reclaim:<reason> / ttl
        self.duplicate_releases = 0
        self.recent: deque[FreedTransfer] = deque(maxlen=remember)  # for the mesh's reconciliation
        self.seq = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._held.values())

    def hold(self, transfer_id: str, blocks: tuple[int, ...], *, request_id: str = "", mesh_id: str = "",
             consumers: int = 1) -> None:
        if transfer_id in self._held:
            raise ValueError(f"transfer {transfer_id} is already held")
        self._held[transfer_id] = Held(transfer_id, blocks, request_id, mesh_id, max(1, consumers),
                                       time.monotonic())

    # -- Holder protocol of the side channel --------------------------------------------------

    def blocks_of(self, transfer_id: str) -> tuple[int, ...] | None:
        h = self._held.get(transfer_id)
        return None if h is None else h.blocks

    def expect_consumers(self, transfer_id: str, tp_size: int) -> None:
        h = self._held.get(transfer_id)
        if h is not None and tp_size >= 1:
            h.consumers = tp_size

    def release_rank(self, transfer_id: str, tp_rank: int) -> bool:
        h = self._held.get(transfer_id)
        if h is None or tp_rank in h.released_ranks:
            self.duplicate_releases += 1
            return False
        h.released_ranks.add(tp_rank)
        if len(h.released_ranks) >= h.consumers:
            self._free(h, "consumer")
        return True

    # -- the mesh's and the TTL's paths -------------------------------------------------------

    def release(self, transfer_id: str, reason: str = "mesh-reclaim") -> bool:
        h = self._held.get(transfer_id)
        if h is None:
            self.duplicate_releases += 1
            return False
        self._free(h, "mesh-reclaim")
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        old = [h for h in self._held.values() if now - h.created > self.ttl_s]
        for h in old:
            self._free(h, "ttl")
        return [h.transfer_id for h in old]

    def _free(self, h: Held, path: str) -> None:
        del self._held[h.transfer_id]
        if self.pool is not None:   # None: the engine owns the blocks (`on_free` gives them back)
            self.pool.release(h.blocks)
        self.freed_by[path] += 1
        self.seq += 1
        self.recent.append(FreedTransfer(transfer_id=h.transfer_id, path=path, request_id=h.request_id,
                                         held_s=round(time.monotonic() - h.created, 4), seq=self.seq))
        if self._on_free is not None:
            self._on_free(h, path)

    def listing(self, since: int = 0) -> HeldList:
        """Held transfers, plus the freed ones with seq > `since` (the ring keeps the newest)."""
        now = time.monotonic()
        freed = tuple(f for f in self.recent if f.seq > since) if since < self.seq else ()
        return HeldList(transfers=tuple(
            HeldTransfer(transfer_id=h.transfer_id, blocks=len(h.blocks), age_s=round(now - h.created, 3),
                         request_id=h.request_id, mesh_id=h.mesh_id)
            for h in self._held.values()), freed=freed, seq=self.seq)
