"""cache_aware: send a prompt where its longest prefix was sent before, unless load is skewed.

The whole rendered prompt (chat: every message) is cut into fixed-size chunks; chunk i's
key is hash(key of chunk i-1, chunk i), so a key names a whole prefix. An index maps each
key to the workers that saw it; each worker keeps its keys in an LRU of bounded size, and
an evicted key leaves the index. A request walks its keys from the first and keeps the
workers that still match; the last non-empty set holds the longest match.

Load guard (as in SGLang's router): when the busiest and idlest candidates differ by more
than `balance_abs` in flight *and* by more than `balance_rel` times, or when the best match
covers less than `min_match` of the prompt, the least-loaded candidate wins instead.
Either way, the chosen worker learns the prompt's keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from contract.snapshot import View, Worker
from policies.base import PolicyBase, RoutingRequest


def chunk_keys(text: str, chunk: int) -> list[int]:
    """Chained hashes of the prompt's full chunks (a trailing partial chunk counts too)."""
    keys: list[int] = []
    h = 0
    for i in range(0, len(text), chunk):
        h = hash((h, text[i:i + chunk]))
        keys.append(h)
    return keys


class CacheAware(PolicyBase):
    name = "cache_aware"

    def __init__(self, chunk_chars: int = 64, max_chunks_per_worker: int = 65536,
                 min_match: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.5) -> None:
        if chunk_chars < 1:
            raise ValueError("chunk_chars must be >= 1")
        if max_chunks_per_worker < 1:
            raise ValueError("max_chunks_per_worker must be >= 1")
        if not 0.0 <= min_match <= 1.0:
            raise ValueError("min_match must be in [0, 1]")
        self.chunk = chunk_chars
        self.capacity = max_chunks_per_worker
        self.min_match = min_match
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._index: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    # -- decision -------------------------------------------------------------------------

    def select(self, request: RoutingRequest, view: View) -> Worker:
        ws = view.workers
        keys = chunk_keys(request.prompt_text(), self.chunk)
        chosen = self._least_loaded(ws, view) if self._imbalanced(ws, view) else None
        if chosen is None:
            chosen = self._best_match(keys, ws, view)
        self._learn(chosen.id, keys)
        return chosen

    def _imbalanced(self, ws: tuple[Worker, ...], view: View) -> bool:
        if len(ws) < 2:
            return False
        loads = [view.load.get(w.id, 0) for w in ws]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def _best_match(self, keys: list[int], ws: tuple[Worker, ...], view: View) -> Worker:
        by_id = {w.id: w for w in ws}
        alive: set[str] = set(by_id)
        matched = 0
        for k in keys:
            holders = self._index.get(k)
            if not holders:
                break
            nxt = alive & holders
            if not nxt:
                break
            alive = nxt
            matched += 1
        if not keys or matched < self.min_match * len(keys):
            return self._least_loaded(ws, view)
        return self._least_loaded(tuple(w for w in ws if w.id in alive), view)

    @staticmethod
    def _least_loaded(ws: tuple[Worker, ...], view: View) -> Worker:
        return min(ws, key=lambda w: view.load.get(w.id, 0))

    # -- index maintenance ----------------------------------------------------------------

    def _learn(self, worker_id: str, keys: list[int]) -> None:
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
        index = self._index
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                index.setdefault(k, set()).add(worker_id)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._unindex(old, worker_id)

    def _unindex(self, key: int, worker_id: str) -> None:
        holders = self._index.get(key)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._index[key]

    def retain(self, worker_ids: Iterable[str]) -> None:
        keep = set(worker_ids)
        for wid in [w for w in self._lru if w not in keep]:
            for k in self._lru.pop(wid):
                self._unindex(k, wid)

    def indexed_chunks(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))
