"""The ledger's I/O: ask each holder what it holds and freed (`GET /kv/held?since=SEQ`), post the
releases the mesh decides on (`POST /kv/release`), and feed every answer to the ledger
(`mesh/ledger.py`, the state machine). docs/protocol.md section 7.

A quick round (every `interval_s`) asks only the pipelines with a transfer waiting on the holder's
word; a full round (every `full_interval_s`, and once at start, to adopt what a former life of this
mesh left) asks every pipeline that serves the holder API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import orjson

from contract.errors import ProtocolError
from contract.protocol import HOLDER_API, HeldList
from contract.snapshot import Worker
from mesh.fleet import Fleet
from mesh.ledger import Entry, Ledger
from mesh.upstream import Upstream

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(self, ledger: Ledger, fleet: Fleet, upstream: Upstream, *, interval_s: float = 0.5,
                 full_interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or full_interval_s <= 0:
            raise ValueError("interval_s and full_interval_s must be > 0")
        self.ledger, self.fleet, self.upstream = ledger, fleet, upstream
        self.interval_s, self.full_interval_s = interval_s, full_interval_s
        self.clock = clock
        self._last_full = float("-inf")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - one bad round must not end reconciliation
                log.exception("ledger reconciliation failed")

    async def reconcile(self, full: bool = False) -> None:
        now = self.clock()
        if full or now - self._last_full >= self.full_interval_s:
            self._last_full = now
            targets = [w for w in self.fleet.workers() if w.role == "prefill" and w.has(HOLDER_API)]
        else:
            targets = self.ledger.pipelines_to_ask()
        if targets:
            await asyncio.gather(*(self._pipeline(w) for w in targets))

    async def _pipeline(self, w: Worker) -> None:
        raw = await self.upstream.get_held(w, self.ledger.since(w))
        try:
            listing = HeldList.decode(orjson.loads(raw), "kv/held") if raw is not None else None
        except (orjson.JSONDecodeError, ProtocolError) as err:
            log.warning("pipeline %s: bad /kv/held answer: %s", w.id, err)
            listing = None
        if listing is None:
            self.ledger.unreachable(w)
            return
        todo = self.ledger.apply(w, listing)
        if todo:
            await asyncio.gather(*(self.reclaim(e, reason) for e, reason in todo))

    async def reclaim(self, e: Entry, reason: str) -> None:
        """Free `e`'s transfer on its pipeline now; the answer tells which path freed it."""
        if not self.ledger.reclaim_start(e):
            return
        released: bool | None = None
        try:
            released = await self.upstream.release(e.pipeline, e.transfer_id, reason)
        finally:
            self.ledger.reclaim_done(e, reason, released)
