"""The KV ledger: every transfer from prefill to release, each ending in exactly one terminal state.

docs/protocol.md section 7. Per request:

    PREFILLING -> HELD (prefill returned its kv_transfer_params) -> DECODING (decode's first byte)
      -> RELEASED   the holder freed it on the consumer's `release`
      -> RECLAIMED  the mesh freed it (`POST /kv/release`): client left before decode had the KV,
                    decode failed before its first byte, or the release was lost (still held
                    `grace_s` after decode finished)
      -> EXPIRED    the holder's own TTL freed it
      -> NO_KV      the prefill never held anything (it failed, or was cut off and nothing
                    showed up for the request id within `grace_s`)
      -> UNRECLAIMABLE  an orphaned transfer on an engine without a release API that no drain leg
                    could free (counted in atomesh_kv_unreclaimable_total, logged with the transfer)

What it tracks (docs/protocol.md sections 7-8): the transfers of pipelines with the holder API, and the
orphaned transfers of pipelines without one (ATOM) that the mesh drains with a one-token decode leg
(`orphan` -> RECLAIMED "drained" or UNRECLAIMABLE). Nothing else: an engine that manages its own KV
(vLLM's lease, SGLang's rooms) is never polled for a listing it does not serve.

The mesh does not see the consumer's release (it goes decode -> stage 0 over ZMQ): it learns
the outcome by reconciling with each pipeline's `GET /kv/held?since=SEQ`, which lists what is
held and what was freed since SEQ, by which path. The same listing lets a restarted mesh adopt
what pipelines still hold under its mesh id, and reclaim it after the grace period.

This module is the state machine alone: no I/O, no tasks, time from an injected clock, so every
transition is a unit test (tests/test_ledger_states.py). `mesh/reconcile.py` does the I/O: it asks
the holders for their listings and posts the releases, and feeds the answers in here.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from contract.protocol import HeldList
from contract.snapshot import Worker

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    PREFILLING = "PREFILLING"
    HELD = "HELD"
    DECODING = "DECODING"
    RELEASED = "RELEASED"
    RECLAIMED = "RECLAIMED"
    EXPIRED = "EXPIRED"
    NO_KV = "NO_KV"
    UNRECLAIMABLE = "UNRECLAIMABLE"


TERMINAL = frozenset({State.RELEASED, State.RECLAIMED, State.EXPIRED, State.NO_KV, State.UNRECLAIMABLE})
_BY_PATH = {"consumer": State.RELEASED, "ttl": State.EXPIRED, "mesh-reclaim": State.RECLAIMED}


@dataclass(slots=True, eq=False)
class Entry:
    request_id: str
    pipeline: Worker
    state: State
    created: float
    transfer_id: str = ""
    blocks: int = 0
    held_at: float = 0.0
    decode_done_at: float = 0.0     # decode finished, or the client left after its first byte
    look_until: float = 0.0         # prefill cut off: look for a transfer of this request until then
    adopted: bool = False           # found on a pipeline under our mesh id, not started by us
    reclaiming: bool = False
    drained: bool = False           # an orphan on an engine without the holder API: freed by a drain leg


class Pools(Protocol):
    """The fleet's per-pipeline free-block view: a held transfer's blocks out, a settled one's back."""
    def kv_taken(self, worker_id: str, blocks: int) -> None: ...
    def kv_returned(self, worker_id: str, blocks: int) -> None: ...


class Outcomes(Protocol):
    """Where terminal states are counted (the mesh's metrics)."""
    def kv_terminal(self, state: str, reason: str, held_s: float | None) -> None: ...
    def unreclaimable(self, pipeline: str) -> None: ...
    def duplicate_release(self) -> None: ...


class Ledger:
    def __init__(self, mesh_id: str, pools: Pools, outcomes: Outcomes, *, grace_s: float = 5.0,
                 recent: int = 200, clock: Callable[[], float] = time.monotonic) -> None:
        if grace_s <= 0:
            raise ValueError("grace_s must be > 0")
        self.mesh_id = mesh_id
        self.fleet = pools
        self.metrics = outcomes
        self.grace_s = grace_s
        self.clock = clock
        # (pipeline id, request id) -> live entry: a request re-paired on another pipeline has one each
        self.open: dict[tuple[str, str], Entry] = {}
        self.by_transfer: dict[str, Entry] = {}
        self.totals: Counter[str] = Counter()           # terminal state -> count (adopted ones apart)
        self.adopted_totals: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self._since: dict[str, int] = {}                # pipeline id -> last freed seq seen
        self._finished: deque[str] = deque(maxlen=8192)  # transfer ids recently finished (no re-adoption)
        self._finished_set: set[str] = set()
        self.began = 0

    # -- the request path (synchronous, cheap) ------------------------------------------------

    def begin(self, request_id: str, pipeline: Worker) -> Entry:
        e = Entry(request_id, pipeline, State.PREFILLING, self.clock())
        self.open[(pipeline.id, request_id)] = e
        self.began += 1
        return e

    def held(self, e: Entry, transfer_id: str, blocks: int) -> None:
        old = self.by_transfer.get(transfer_id)
        if old is not None and old.adopted:  # a listing raced the prefill answer: ours, not adopted
            self._drop(old)
        e.state, e.transfer_id, e.blocks, e.held_at = State.HELD, transfer_id, blocks, self.clock()
        self.by_transfer[transfer_id] = e
        self.fleet.kv_taken(e.pipeline.id, blocks)

    def orphan(self, request_id: str, pipeline: Worker, transfer_id: str, blocks: int) -> Entry:
        """A transfer of a pipeline without the holder API whose decode never pulled it: the mesh
        drains it (`drained` / `unreclaimable` end it); reconciliation never polls for it."""
        e = Entry(f"{request_id}:drain:{transfer_id}", pipeline, State.HELD, self.clock(), transfer_id, blocks,
                  held_at=self.clock(), drained=True)
        self.open[(pipeline.id, e.request_id)] = e
        self.began += 1
        return e

    def drained(self, e: Entry) -> None:
        self.finish(e, State.RECLAIMED, "drained")

    def unreclaimable(self, e: Entry, why: str) -> None:
        log.warning("transfer %s on %s (%d blocks) could not be freed: %s", e.transfer_id, e.pipeline.id,
                    e.blocks, why)
        self.metrics.unreclaimable(e.pipeline.id)
        self.finish(e, State.UNRECLAIMABLE, "no-drain")

    def prefill_failed(self, e: Entry, *, uncertain: bool) -> None:
        """A definite refusal ends as NO_KV; a cut-off prefill is looked for until the grace ends."""
        if uncertain:
            e.look_until = self.clock() + self.grace_s
        else:
            self.finish(e, State.NO_KV, "prefill-failed")

    def decoding(self, e: Entry) -> None:
        if e.state == State.HELD:
            e.state = State.DECODING

    def decode_done(self, e: Entry) -> None:
        if e.state not in TERMINAL:
            e.decode_done_at = self.clock()

    def finish(self, e: Entry, state: State, reason: str, held_s: float | None = None) -> None:
        if e.state in TERMINAL:
            return
        e.state = state
        self._drop(e)
        if e.transfer_id:
            if len(self._finished) == self._finished.maxlen:
                self._finished_set.discard(self._finished[0])  # about to fall off the ring
            self._finished.append(e.transfer_id)
            self._finished_set.add(e.transfer_id)
            if state != State.NO_KV and not e.adopted:
                self.fleet.kv_returned(e.pipeline.id, e.blocks)
        (self.adopted_totals if e.adopted else self.totals)[state.value] += 1
        if held_s is None and e.held_at:
            held_s = self.clock() - e.held_at
        self.metrics.kv_terminal(state.value, reason, held_s if state != State.NO_KV else None)
        self.recent.append({"request_id": e.request_id, "transfer_id": e.transfer_id, "pipeline": e.pipeline.id,
                            "state": state.value, "reason": reason, "adopted": e.adopted,
                            "held_s": None if held_s is None else round(held_s, 4)})

    def _drop(self, e: Entry) -> None:
        key = (e.pipeline.id, e.request_id)
        if self.open.get(key) is e:
            del self.open[key]
        if e.transfer_id and self.by_transfer.get(e.transfer_id) is e:
            del self.by_transfer[e.transfer_id]

    # -- reclaiming -----------------------------------------------------------------------

    def reclaim_start(self, e: Entry) -> bool:
        """May the mesh post a release for `e` now (held, not settled, none in flight)?"""
        if e.state in TERMINAL or e.reclaiming or not e.transfer_id:
            return False
        e.reclaiming = True
        return True

    def reclaim_done(self, e: Entry, reason: str, released: bool | None) -> None:
        """The holder's answer to the release: True freed it; False, another path had (the next
        listing tells which); None, the pipeline could not be asked (reconciliation settles it
        after the grace)."""
        e.reclaiming = False
        if released is True:
            self.finish(e, State.RECLAIMED, reason)
            return
        if released is False:
            self.metrics.duplicate_release()
        e.decode_done_at = e.decode_done_at or self.clock()

    # -- reconciliation (the decisions; mesh/reconcile.py asks and answers) ---------------------

    def pipelines_to_ask(self) -> list[Worker]:
        """The pipelines a quick round asks: those with a transfer waiting on the holder's word."""
        seen: dict[str, Worker] = {}
        for e in self.open.values():
            if e.drained:
                continue
            if e.decode_done_at or e.look_until or e.state == State.DECODING:
                seen.setdefault(e.pipeline.id, e.pipeline)
        return list(seen.values())

    def since(self, w: Worker) -> int:
        """The freed-records sequence number to ask `w`'s holder from."""
        return self._since.get(w.id, 0)

    def apply(self, w: Worker, listing: HeldList) -> list[tuple[Entry, str]]:
        """A holder's listing: settle what it says was freed, take over what a cut-off prefill
        held, adopt what a former life of this mesh left, and return the transfers to reclaim now
        (entry, reason)."""
        if listing.seq < self._since.get(w.id, 0):  # the holder restarted: its old transfers are gone
            for gone in [x for x in self.open.values() if x.pipeline.id == w.id and x.transfer_id]:
                self.finish(gone, State.RELEASED, "holder-restarted")
        self._since[w.id] = listing.seq
        for f in listing.freed:
            e = self.by_transfer.get(f.transfer_id)
            if e is None and f.request_id:  # a cut-off prefill whose transfer was freed before we saw it
                cand = self.open.get((w.id, f.request_id))
                if cand is not None and cand.pipeline.id == w.id and cand.look_until and not cand.transfer_id:
                    e = cand
                    e.transfer_id = f.transfer_id
            if e is not None:
                self.finish(e, _BY_PATH.get(f.path, State.RELEASED), f"holder:{f.path}", held_s=f.held_s)
        now = self.clock()
        held_ids: set[str] = set()
        pending: list[tuple[Entry, str]] = []
        for t in listing.transfers:
            held_ids.add(t.transfer_id)
            e = self.by_transfer.get(t.transfer_id)
            if e is None and t.request_id and t.mesh_id == self.mesh_id:   # never a sibling's or another
                e = self.open.get((w.id, t.request_id))                     # replica's (same request id)
                if e is not None and e.pipeline.id == w.id and e.look_until and not e.transfer_id:
                    # a prefill we cut off did hold KV after all: take it over and free it
                    e.transfer_id, e.blocks, e.held_at = t.transfer_id, t.blocks, now - t.age_s
                    self.by_transfer[t.transfer_id] = e
                    pending.append((e, "client-disconnect"))
                    continue
                e = None
            if e is None:
                if t.mesh_id == self.mesh_id and t.age_s > self.grace_s and t.transfer_id not in self._finished_set:
                    self._adopt(w, t.transfer_id, t.blocks, t.request_id, t.age_s)
                continue
            if e.decode_done_at and now - e.decode_done_at > self.grace_s:
                pending.append((e, "lost-release"))
        for e in [e for e in self.open.values() if e.pipeline.id == w.id and not e.drained]:
            if e.look_until and not e.transfer_id and now > e.look_until:
                self.finish(e, State.NO_KV, "prefill-cut-off")
            elif e.transfer_id and e.transfer_id not in held_ids and (e.decode_done_at or e.adopted) \
                    and now - max(e.decode_done_at, e.held_at) > self.grace_s:
                # gone from the holder, and not in its freed records (the ring wrapped)
                self.finish(e, State.RELEASED, "not-listed")
        return pending

    def unreachable(self, w: Worker) -> None:
        """The holder cannot be asked. Past a few grace periods, close what waits on it: a cut-off
        prefill as NO_KV, a held transfer as EXPIRED (the holder's own TTL frees it if it lives)."""
        now = self.clock()
        for e in [e for e in self.open.values() if e.pipeline.id == w.id and not e.drained]:
            if e.look_until and not e.transfer_id and now > e.look_until + self.grace_s:
                self.finish(e, State.NO_KV, "holder-unreachable")
            elif e.transfer_id and (e.decode_done_at or e.adopted) and now - e.decode_done_at > 3 * self.grace_s:
                self.finish(e, State.EXPIRED, "holder-unreachable")

    def _adopt(self, w: Worker, transfer_id: str, blocks: int, request_id: str, age_s: float) -> None:
        now = self.clock()
        e = Entry(request_id or f"adopted:{transfer_id}", w, State.DECODING, now - age_s, transfer_id, blocks,
                  held_at=now - age_s, decode_done_at=now - self.grace_s, adopted=True)
        self.open[(w.id, e.request_id)] = e
        self.by_transfer[transfer_id] = e
        log.info("adopted transfer %s on %s (held %.1fs under this mesh id)", transfer_id, w.id, age_s)

    # -- views ----------------------------------------------------------------------------

    def held_by_pipeline(self) -> dict[str, dict[str, float]]:
        now = self.clock()
        out: dict[str, dict[str, float]] = {}
        for e in self.open.values():
            if e.transfer_id:
                d = out.setdefault(e.pipeline.id, {"transfers": 0, "blocks": 0, "oldest_age_s": 0.0})
                d["transfers"] += 1
                d["blocks"] += e.blocks
                d["oldest_age_s"] = max(d["oldest_age_s"], round(now - e.held_at, 3))
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"mesh_id": self.mesh_id, "held": self.held_by_pipeline(),
                "open": dict(Counter(e.state.value for e in self.open.values())),
                "terminal": dict(self.totals), "adopted_terminal": dict(self.adopted_totals),
                "recent": list(self.recent)}

    def gauge_rows(self) -> Iterable[tuple[str, int, int, float]]:
        for pid, d in self.held_by_pipeline().items():
            yield pid, int(d["transfers"]), int(d["blocks"]), d["oldest_age_s"]
