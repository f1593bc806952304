"""The mesh's live picture of its fleet: membership, health, load and the routing table.

Membership comes from a `Registry` (static here, etcd later). Health comes from an active
probe every `health_interval` seconds, gated by the worker's capabilities (docs/protocol.md section 8):
`GET /load` where the worker declares `load_v1`, `GET /health` otherwise, and passively from
failed calls. A worker that declares no capability (a static `--prefill URL`) is asked `GET /load`
once: a load report there lists its capabilities; any other answer means it has none. The routing table is rebuilt only when membership or health changes; the
request path reads `fleet.table` and the `in_flight` counter dict, nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Iterable, Protocol

import aiohttp
import orjson

from contract.errors import ProtocolError
from contract.protocol import LOAD_V1, LoadReport, check_capabilities
from contract.snapshot import RoutingTable, Worker

log = logging.getLogger(__name__)


class Registry(Protocol):
    """Where membership comes from. `workers()` is an immutable snapshot."""

    def workers(self) -> tuple[Worker, ...]: ...

    @property
    def stale(self) -> bool: ...

    async def start(self, on_change: Callable[[], None]) -> None: ...

    async def close(self) -> None: ...


class StaticRegistry:
    """Workers given on the command line or in a TOML file; never changes."""

    stale = False

    def __init__(self, workers: Iterable[Worker]) -> None:
        self._workers = tuple(workers)

    def workers(self) -> tuple[Worker, ...]:
        return self._workers

    async def start(self, on_change: Callable[[], None]) -> None:
        on_change()

    async def close(self) -> None:
        pass


class Fleet:
    def __init__(self, registry: Registry, *, unhealthy_after: int = 2, breaker_open_s: float = 5.0,
                 on_rebuild: Callable[[RoutingTable], None] | None = None, kv_leak_after: float = 120.0) -> None:
        self.registry = registry
        self.unhealthy_after = unhealthy_after
        self.breaker_open_s = breaker_open_s
        self._open_until: dict[str, float] = {}   # circuit open: out of routing until then
        self.in_flight: dict[str, int] = {}
        self.loads: dict[str, LoadReport] = {}
        self.models: dict[str, str] = {}          # learnt from /v1/models when not configured
        self.kv_free: dict[str, int] = {}         # free KV blocks per pipeline: probed, then tracked
        self._fails: dict[str, int] = {}          # consecutive failed calls (the circuit breaker)
        self._probe_fails: dict[str, int] = {}    # consecutive failed /load probes
        self._last_ok: dict[str, float] = {}      # when a call to the worker last went well
        self._no_load: set[str] = set()           # workers without /load: probed at /health
        self.learnt_caps: dict[str, tuple[str, ...]] = {}  # from /load, for workers that declare none
        self.cards: dict[str, dict[str, object]] = {}      # the worker's own /v1/models entry (max_model_len, root...)
        self.kv_leak_after = kv_leak_after
        self._unaccounted_since: dict[str, float] = {}   # census off since (monotonic)
        self.kv_unaccounted: dict[str, int] = {}         # the leak alarm: blocks unaccounted, per worker
        self._healthy: set[str] = set()
        self._known: tuple[Worker, ...] = ()
        self._on_rebuild = on_rebuild
        self.table = RoutingTable()

    # -- membership and health -> routing table ----------------------------------------------

    def workers(self) -> tuple[Worker, ...]:
        """Registry workers, with models learnt from the workers filled in."""
        out = []
        for w in self.registry.workers():
            if not w.model and self.models.get(w.id):
                w = dataclasses.replace(w, model=self.models[w.id])
            caps = self.learnt_caps.get(w.id)
            if caps and not w.record.capabilities:
                w = dataclasses.replace(w, record=dataclasses.replace(w.record, capabilities=caps))
            out.append(w)
        return tuple(out)

    def on_membership(self) -> None:
        ws = self.registry.workers()
        new = {w.id for w in ws} - {w.id for w in self._known}
        self._healthy |= new          # optimistic until a probe or a call says otherwise
        self._known = ws
        self.rebuild()

    def rebuild(self) -> None:
        ws = self.workers()
        ids = {w.id for w in ws}
        self._healthy &= ids
        for d in (self._fails, self._probe_fails, self._last_ok, self._open_until, self.loads, self.models, self.kv_free,
                  self.learnt_caps, self.cards, self._unaccounted_since, self.kv_unaccounted):
            for k in [k for k in d if k not in ids]:
                del d[k]
        self.table = RoutingTable.build(ws, frozenset(self._healthy))
        if self._on_rebuild is not None:
            self._on_rebuild(self.table)

    def healthy(self, worker_id: str) -> bool:
        return worker_id in self._healthy

    def mark_failed(self, worker_id: str) -> None:
        """Circuit breaker: `unhealthy_after` consecutive failures open it for `breaker_open_s`;
        then it is half-open (routable again, one more failure re-opens it); a success closes it."""
        n = self._fails.get(worker_id, 0) + 1
        self._fails[worker_id] = n
        if n >= self.unhealthy_after and worker_id in self._healthy:
            self._healthy.discard(worker_id)
            self._open_until[worker_id] = time.monotonic() + self.breaker_open_s
            log.warning("worker %s: circuit open after %d consecutive failures", worker_id, n)
            self.rebuild()

    def succeeded(self, worker_id: str) -> None:
        """A call went well: close the breaker (cheap when it was closed already)."""
        self._last_ok[worker_id] = time.monotonic()
        if self._fails.get(worker_id):
            self._fails[worker_id] = 0
            self._open_until.pop(worker_id, None)

    def half_open(self) -> None:
        """Breakers whose open time is over let traffic try again (one failure re-opens them)."""
        now = time.monotonic()
        due = [w for w, t in self._open_until.items() if now >= t]
        for w in due:
            del self._open_until[w]
            self._fails[w] = self.unhealthy_after - 1
            self._healthy.add(w)
            log.info("worker %s: circuit half-open", w)
        if due:
            self.rebuild()

    def kv_taken(self, worker_id: str, blocks: int) -> None:
        if worker_id in self.kv_free:
            self.kv_free[worker_id] -= blocks

    def kv_returned(self, worker_id: str, blocks: int) -> None:
        if worker_id in self.kv_free:
            load = self.loads.get(worker_id)
            cap = load.num_blocks if load and load.num_blocks else self.kv_free[worker_id] + blocks
            self.kv_free[worker_id] = min(cap, self.kv_free[worker_id] + blocks)

    def healthy_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self._known:
            if w.id in self._healthy:
                out[w.role] = out.get(w.role, 0) + 1
        return out

    def in_flight_rows(self) -> list[tuple[str, str, int]]:
        return [(w.id, w.role, self.in_flight.get(w.id, 0)) for w in self._known]

    # -- active probe ---------------------------------------------------------------------

    async def probe_all(self, session: aiohttp.ClientSession, timeout: float) -> None:
        ws = self.workers()
        await asyncio.gather(*(self._probe(session, w, timeout) for w in ws))
        self.rebuild()

    async def _probe(self, session: aiohttp.ClientSession, w: Worker, timeout: float) -> None:
        to = aiohttp.ClientTimeout(total=timeout)
        declared = w.record.capabilities
        try:
            if LOAD_V1 in declared or (not declared and w.id not in self._no_load):
                async with session.get(f"{w.url}/load", timeout=to, headers=w.auth) as r:
                    raw = await r.read() if r.status == 200 else b""
                    status = r.status
                load = None
                if status == 200:
                    try:
                        load = LoadReport.decode(orjson.loads(raw), "load")
                        check_capabilities(load.capabilities, "load.capabilities")
                    except (orjson.JSONDecodeError, ProtocolError):
                        if declared:
                            raise
                if load is not None:
                    self.loads[w.id] = load
                    self._census(w, load)
                    if not declared:
                        self.learnt_caps[w.id] = load.capabilities
                    if w.role == "prefill" and load.num_blocks:
                        self.kv_free[w.id] = load.free_blocks
                elif declared:
                    raise ProtocolError(f"/load answered {status}")
                else:  # no load report here (404, or another engine's /load): /health from now on
                    self._no_load.add(w.id)
            if LOAD_V1 not in w.record.capabilities and (declared or w.id in self._no_load):
                async with session.get(f"{w.url}/health", timeout=to, headers=w.auth) as r:
                    if r.status != 200:
                        raise ProtocolError(f"/health answered {r.status}")
            if not w.model or w.id not in self.cards:
                async with session.get(f"{w.url}/v1/models", timeout=to, headers=w.auth) as r:
                    data = orjson.loads(await r.read()) if r.status == 200 else {}
                cards = [m for m in data.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
                if cards and not w.model:
                    self.models[w.id] = cards[0]["id"]
                mine = [c for c in cards if c["id"] == (w.model or cards[0]["id"])]
                self.cards[w.id] = mine[0] if mine else {}
        except (aiohttp.ClientError, TimeoutError, ProtocolError, orjson.JSONDecodeError,
                AttributeError, KeyError, TypeError) as e:
            log.debug("probe of %s failed: %s", w.id, e)
            if isinstance(e, TimeoutError) and (self.in_flight.get(w.id, 0) > 0
                                                or time.monotonic() - self._last_ok.get(w.id, -1e9) < 2 * timeout):
                # a slow probe of a worker that is answering calls, or busy with some (an engine's
                # first request of a kind can block its /health for seconds), is not a failure: a
                # worker that is really stuck fails those calls, and the passive breaker takes it out
                return
            n = self._probe_fails[w.id] = self._probe_fails.get(w.id, 0) + 1
            if n >= self.unhealthy_after:
                self._healthy.discard(w.id)
            return
        self._probe_fails[w.id] = 0
        if w.id in self.kv_unaccounted:  # the leak alarm: out of routing until its blocks add up
            self._healthy.discard(w.id)
        elif w.id not in self._open_until:  # an open breaker waits for its time even if /load answers
            self._healthy.add(w.id)

    def _census(self, w: Worker, load: LoadReport) -> None:
        """The leak alarm: a worker whose free + held + running blocks differ from its pool for
        longer than `kv_leak_after` is logged, counted (`atomesh_kv_unaccounted_blocks`), named by
        `/ready` and `/workers`, and routed around until its census adds up again."""
        if load.held_blocks is None or load.running_blocks is None or not load.num_blocks:
            return
        off = load.num_blocks - load.free_blocks - load.held_blocks - load.running_blocks
        now = time.monotonic()
        if off == 0:
            self._unaccounted_since.pop(w.id, None)
            if self.kv_unaccounted.pop(w.id, None) is not None:
                log.warning("worker %s: every KV block accounted for again; back in routing", w.id)
            return
        since = self._unaccounted_since.setdefault(w.id, now)
        if now - since >= self.kv_leak_after:
            raised = w.id not in self.kv_unaccounted
            self.kv_unaccounted[w.id] = off
            if raised:
                log.error("worker %s: %d KV blocks unaccounted for %.0fs (free %d + held %d + running %d of %d): "
                          "leak alarm, out of routing", w.id, off, now - since, load.free_blocks, load.held_blocks,
                          load.running_blocks, load.num_blocks)
                # out of routing in the same step as the alarm goes up, not when the probe round
                # ends: /ready and /workers must never show the alarm with the worker still routable
                self._healthy.discard(w.id)
                self.rebuild()

    async def run_probes(self, session: aiohttp.ClientSession, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.half_open()
            try:
                await self.probe_all(session, timeout=max(0.5, interval))
            except Exception:  # noqa: BLE001 - the probe loop must outlive any one bad round
                log.exception("health probe round failed")
