"""Admission control: a concurrency limit with a bounded FIFO queue and a queue timeout.

Over the limit a request waits in the queue; a full queue or a wait past `queue_timeout` is
`Overloaded` (429 with Retry-After). An optional per-API-key limit works the same way, so one
client cannot take every slot. A slot is handed straight to the next waiter on release.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from contract.errors import ConfigError, Overloaded


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_concurrency: int = 0        # 0: no limit
    max_queue: int = 256
    queue_timeout: float = 5.0
    per_key_concurrency: int = 0    # 0: no per-key limit

    def __post_init__(self) -> None:
        if self.max_concurrency < 0 or self.max_queue < 0 or self.per_key_concurrency < 0:
            raise ConfigError("admission limits must be >= 0")
        if self.queue_timeout <= 0:
            raise ConfigError("admission queue_timeout must be > 0")


class Gate:
    """`limit` concurrent holders, `max_queue` waiters at most."""

    def __init__(self, limit: int, max_queue: int, timeout: float, what: str) -> None:
        self.limit, self.max_queue, self.timeout, self.what = limit, max_queue, timeout, what
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queue:
            self.rejected += 1
            raise Overloaded(f"{self.what}: {self.active} requests running and {len(self._waiters)} queued",
                             headers={"Retry-After": "1"})
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except TimeoutError:
            if fut.done():  # handed a slot at the last moment: keep it
                return
            fut.cancel()
            self._waiters.remove(fut)
            self.rejected += 1
            raise Overloaded(f"{self.what}: waited {self.timeout:g}s in the queue", headers={"Retry-After": "1"}) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was ours: pass it on
            else:
                fut.cancel()
                if fut in self._waiters:
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot goes straight to the next waiter
                return
        self.active -= 1


class Admission:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.gate = Gate(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout, "the mesh is at capacity") \
            if cfg.max_concurrency else None
        self.per_key: dict[str, Gate] = {}

    def unlimited(self, key: str | None) -> bool:
        """No limit applies to a request with this key: `slot` would admit it at once and hold
        nothing (the caller skips it: an async context manager per request costs a few us)."""
        return self.gate is None and (key is None or not self.cfg.per_key_concurrency)

    @asynccontextmanager
    async def slot(self, key: str | None) -> AsyncIterator[None]:
        gates = []
        if key is not None and self.cfg.per_key_concurrency:
            g = self.per_key.get(key)
            if g is None:
                g = self.per_key[key] = Gate(self.cfg.per_key_concurrency, self.cfg.max_queue, self.cfg.queue_timeout,
                                             "this API key is at its concurrency limit")
            gates.append(g)
        if self.gate is not None:
            gates.append(self.gate)
        taken: list[Gate] = []
        try:
            for g in gates:
                await g.acquire()
                taken.append(g)
            yield
        finally:
            for g in taken:
                g.release()
