"""cache_aware: send a prompt where its longest prefix was sent before, unless load is skewed.

The whole rendered prompt (chat: every message) is cut into chunks whose size depends on their
position only (`chunk_keys`: fine at the start, coarser far into long prompts); chunk i's key is
hash(key of chunk i-1, chunk i), so a key names a whole prefix. An index maps each
key to the workers that saw it; each worker keeps its keys in an LRU of bounded size, and
an evicted key leaves the index. A request walks its keys from the first and keeps the
workers that still match; the last non-empty set holds the longest match.

Load guard (as in SGLang's router): when the busiest and idlest candidates differ by more
than `balance_abs` in flight *and* by more than `balance_rel` times, or when the best match
covers less than `min_match` of the prompt's bytes, the least-loaded candidate wins instead.
Either way, the chosen worker learns the prompt's keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from xxhash import xxh3_64_intdigest

from contract.snapshot import View, Worker
from policies.base import PolicyBase, RoutingRequest

# the chunk grid, in base chunks (`chunk` bytes): (up to here, chunks of this many). With the 64-byte
# base: 64 B chunks to 2 kB, 256 B to 4 kB, 1 kB to 16 kB, 4 kB to 64 kB, then 16 kB (`FAR`)
TIERS = ((32, 1), (64, 4), (256, 16), (1024, 64))
FAR = 256


def chunk_keys(text: str, chunk: int) -> tuple[list[int], list[int]]:
    """Chained hashes of the prompt's chunks (a trailing partial chunk counts too) and where each
    chunk ends, in bytes of its UTF-8 text. A chunk's size depends on where it starts only
    (`TIERS`: fine at the start, where prompts diverge, coarser far into long prompts), so equal
    prefixes give equal keys: a 1 kB prompt has 16 keys, 220 kB 74, 1 MB 122 (not ~16,000 of one
    size; each key costs the index an update per request: bench/overhead.py --prompt-bytes). The
    grid is the coarsest of those tried whose hit rate on shared prefixes equals the finer grids'
    (bench/cache_hits.py, four workloads). A key is XXH3-64 of its chunk seeded with the key
    before (~60 GB/s: a 220 kB prompt's keys in ~20 us; Python's string hash took ~110)."""
    data = text.encode("utf-8", "surrogatepass")
    view = memoryview(data)
    n = len(data)
    if not n:
        return [], []
    ends: list[int] = []   # the grid's points before n, then n
    at = 0
    for upto, size in TIERS:
        stop = upto * chunk
        ends += range(at + size * chunk, min(n, stop + 1), size * chunk)
        at = stop
        if n <= stop:
            break
    else:
        ends += range(at + FAR * chunk, n, FAR * chunk)
    ends.append(n)
    keys: list[int] = []
    h = i = 0
    for j in ends:
        keys.append(h := xxh3_64_intdigest(view[i:j], h))
        i = j
    return keys, ends


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
        # key -> bit mask of the workers that saw it (one bit per worker, `_slot`): ints, not sets,
        # so the index holds no garbage-collected containers (hundreds of thousands of keys)
        self._index: dict[int, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._slot: dict[str, int] = {}
        self._free: list[int] = []

    # -- decision -------------------------------------------------------------------------

    def select(self, request: RoutingRequest, view: View) -> Worker:
        ws = view.workers
        keys, ends = chunk_keys(request.prompt_text(), self.chunk)
        chosen = self._least_loaded(ws, view) if self._imbalanced(ws, view) else None
        if chosen is None:
            chosen = self._best_match(keys, ends, ws, view)
        self._learn(chosen.id, keys)
        return chosen

    def _imbalanced(self, ws: tuple[Worker, ...], view: View) -> bool:
        if len(ws) < 2:
            return False
        loads = [view.load.get(w.id, 0) for w in ws]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def _best_match(self, keys: list[int], ends: list[int], ws: tuple[Worker, ...], view: View) -> Worker:
        slot = self._slot
        alive = 0
        for w in ws:
            if w.id in slot:
                alive |= 1 << slot[w.id]
        index = self._index
        matched = 0
        for k in keys:
            nxt = alive & index.get(k, 0)
            if not nxt:
                break
            alive = nxt
            matched += 1
        if not keys or (ends[matched - 1] if matched else 0) < self.min_match * ends[-1]:   # bytes matched
            return self._least_loaded(ws, view)
        return self._least_loaded(tuple(w for w in ws if w.id in slot and alive >> slot[w.id] & 1), view)

    @staticmethod
    def _least_loaded(ws: tuple[Worker, ...], view: View) -> Worker:
        return min(ws, key=lambda w: view.load.get(w.id, 0))

    # -- index maintenance ----------------------------------------------------------------

    def _learn(self, worker_id: str, keys: list[int]) -> None:
        lru = self._lru.get(worker_id)
        if lru is None:
            lru = self._lru[worker_id] = OrderedDict()
            self._slot[worker_id] = self._free.pop() if self._free else len(self._slot)
        bit = 1 << self._slot[worker_id]
        index = self._index
        get, move = index.get, lru.move_to_end
        for k in keys:
            if k in lru:
                move(k)
            else:
                lru[k] = None
                index[k] = get(k, 0) | bit
        excess = len(lru) - self.capacity
        if excess > 0:
            pop, other = lru.popitem, ~bit
            for _ in range(excess):
                old = pop(last=False)[0]
                rest = get(old, 0) & other
                if rest:
                    index[old] = rest
                else:
                    del index[old]

    def _unindex(self, key: int, bit: int) -> None:
        rest = self._index.get(key, 0) & ~bit
        if rest:
            self._index[key] = rest
        else:
            self._index.pop(key, None)

    def retain(self, worker_ids: Iterable[str]) -> None:
        keep = set(worker_ids)
        for wid in [w for w in self._lru if w not in keep]:
            slot = self._slot.pop(wid)
            for k in self._lru.pop(wid):
                self._unindex(k, 1 << slot)
            self._free.append(slot)

    def indexed_chunks(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))
