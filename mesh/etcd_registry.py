"""The etcd registry: the mesh follows `<prefix>/<cluster>/` live.

One resilient loop: list the prefix (its revision is where the watch starts), watch from the
last seen revision + 1, and on any error (etcd restart, leader change, a hung server caught
by the heartbeat) reconnect and resume from there; after `RevisionCompactedError` re-list.
While etcd is unreachable the mesh serves from its last snapshot and reports itself stale
(`/ready`, `atomesh_registry_stale`).

A prefill pipeline is routable only while its record and the liveness keys of all its
`pp_size` stages are present: each stage's key lives under that stage's own lease, so one
dead stage takes its whole pipeline out of routing within one TTL.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import aetcd
import orjson

from contract.dialects import check_dialect
from contract.errors import ProtocolError
from contract.etcd import EtcdConfig, Keys, open_client
from contract.protocol import DecodeRecord, MeshRecord, PrefillRecord, StageLiveness, check_capabilities
from contract.snapshot import Worker

log = logging.getLogger(__name__)


def check_record(rec: Any, where: str) -> Any:
    """What a worker record must be before anything is routed to it: an http(s) URL with a host,
    no userinfo, an ASCII port in 1..65535; sizes >= 1; a known dialect and capabilities."""
    check_url(rec.url, where + ".url")
    check_dialect(rec.dialect, where + ".dialect")
    check_capabilities(rec.capabilities, where + ".capabilities")
    for f in ("pp_size", "tp_size", "block_size"):
        if getattr(rec, f, 1) < 1:
            raise ProtocolError(f"{where}.{f} must be >= 1")
    if rec.num_blocks < 0:
        raise ProtocolError(f"{where}.num_blocks must be >= 0")
    env = getattr(rec, "api_key_env", "")
    if env and not (env.startswith("ATOMESH_") and len(env) > 8 and env.isascii() and env.replace("_", "").isalnum() and env.isupper()):
        # a record names which of the mesh's variables it is sent as a Bearer token: only ATOMESH_*
        # ones, so a record written by someone else cannot have the mesh send it, say, a cloud key
        raise ProtocolError(f"{where}.api_key_env must name an ATOMESH_* variable, got {env!r}",
                            param=where + ".api_key_env")
    return rec


def check_url(url: str, where: str) -> None:
    p = urlsplit(url)
    port = url.split("://", 1)[-1].split("/", 1)[0].rpartition(":")[2] if p.port is not None else ""
    if p.scheme not in ("http", "https") or not p.hostname or p.username is not None or p.password is not None \
            or (port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)):
        raise ProtocolError(f"{where}: {url!r} is not an http(s) URL with a host and a port in 1..65535",
                            param=where)


Entry = tuple[str, str, "int | None", Any]   # (kind, id, stage rank, Worker | MeshRecord | StageLiveness)


def parse_entry(keys: Keys, key: bytes, value: bytes) -> Entry | None:
    """One registry key/value, parsed and checked (a Worker is built for a prefill or decode record):
    None for a key that is not ours or a value that is bad (logged), never an exception."""
    name = key.decode("utf-8", "replace")
    try:  # one key at a time: a bad key or record is skipped, never the whole registry
        key.decode("utf-8")   # a key that is not UTF-8 is not one of ours
        what = keys.parse(key)
        if what is None:
            return None
        kind, ident, rank = what
        data = orjson.loads(value)
        if kind == "prefill":
            rec: Any = check_record(PrefillRecord.decode(data, name), name)
            return kind, ident, rank, Worker(id=ident, role="prefill", url=rec.url, model=rec.model, record=rec)
        if kind == "decode":
            drec = check_record(DecodeRecord.decode(data, name), name)
            return kind, ident, rank, Worker(id=ident, role="decode", url=drec.url, model=drec.model, record=drec)
        if kind == "mesh":
            return kind, ident, rank, MeshRecord.decode(data, name)
        return kind, ident, rank, StageLiveness.decode(data, name)
    except Exception as e:  # noqa: BLE001 - whatever a key holds, the others still count
        log.warning("ignoring bad registry value at %r: %s", name[:200], e)
        return None


def assemble(entries: Any) -> tuple[tuple[Worker, ...], dict[str, MeshRecord], dict[str, dict[int, StageLiveness]]]:
    """Routable workers, mesh replicas and live stages from parsed entries: a pipeline is routable
    while the liveness keys of all its stages are present."""
    pipelines: dict[str, Worker] = {}
    decodes: dict[str, Worker] = {}
    meshes: dict[str, MeshRecord] = {}
    stages: dict[str, dict[int, StageLiveness]] = {}
    for kind, ident, rank, obj in entries:
        if kind == "prefill":
            pipelines[ident] = obj
        elif kind == "decode":
            decodes[ident] = obj
        elif kind == "mesh":
            meshes[ident] = obj
        else:
            stages.setdefault(ident, {})[rank] = obj
    for wid in pipelines.keys() & decodes.keys():
        # the fleet keeps one breaker and one in-flight count per worker id: a decode record under a
        # pipeline's id (or the other way round) would share them. Neither is routed until one goes.
        log.warning("registry: %r is both a prefill pipeline and a decode engine; routing neither", wid[:200])
        del pipelines[wid], decodes[wid]
    out: list[Worker] = []
    for pid, w in sorted(pipelines.items()):
        live = stages.get(pid, {})
        # (type: ignore below) prefill workers' records are PrefillRecords
        if all(r in live for r in range(w.record.pp_size)):  # type: ignore[union-attr]
            out.append(w)
    out += [w for _, w in sorted(decodes.items())]
    return tuple(out), meshes, stages


def build_workers(keys: Keys, kv: dict[bytes, bytes]) -> tuple[tuple[Worker, ...], dict[str, MeshRecord],
                                                                 dict[str, dict[int, StageLiveness]]]:
    """Routable workers, mesh replicas and live stages from the raw key/values."""
    return assemble(e for e in (parse_entry(keys, k, v) for k, v in kv.items()) if e is not None)


class EtcdRegistry:
    def __init__(self, cfg: EtcdConfig, *, heartbeat_s: float = 2.0,
                 on_stale: Callable[[bool], None] | None = None, debounce_s: float = 0.05) -> None:
        """`debounce_s`: watch events within this long of each other make one rebuild of the
        routing view (a burst of 1,600 puts or one `delete_prefix` is one rebuild, not 1,600)."""
        self.cfg = cfg
        self.keys = cfg.keys
        self.heartbeat_s = heartbeat_s
        self._on_stale = on_stale
        self.debounce_s = debounce_s
        self._entries: dict[bytes, Entry] = {}   # each key parsed once, when its value changes
        self._pending: asyncio.TimerHandle | None = None
        self.publishes = 0
        self.events = 0
        self._rev: int | None = None     # last revision applied; None: list again
        self._workers: tuple[Worker, ...] = ()
        self.meshes: dict[str, MeshRecord] = {}
        self.stages: dict[str, dict[int, StageLiveness]] = {}
        self._stale = True
        self.stale_since: float | None = time.monotonic()
        self.watch_restarts = 0
        self.relists = 0
        self._on_change: Callable[[], None] = lambda: None
        self._task: asyncio.Task[None] | None = None
        self._endpoint = 0
        self.synced = asyncio.Event()

    # -- Registry protocol ----------------------------------------------------------------

    def workers(self) -> tuple[Worker, ...]:
        return self._workers

    @property
    def stale(self) -> bool:
        return self._stale

    async def start(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._task = asyncio.create_task(self._loop(), name="etcd-registry")
        try:  # serve at once if etcd answers soon; otherwise start stale and catch up later
            await asyncio.wait_for(asyncio.shield(self.synced.wait()), self.cfg.timeout)
        except TimeoutError:
            log.warning("etcd at %s not reachable yet; starting with an empty registry", self.cfg.endpoints)

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- the loop -------------------------------------------------------------------------

    def _set_stale(self, stale: bool) -> None:
        if stale == self._stale:
            return
        self._stale = stale
        self.stale_since = time.monotonic() if stale else None
        log.log(logging.WARNING if stale else logging.INFO, "registry is %s", "stale" if stale else "live again")
        if self._on_stale is not None:
            self._on_stale(stale)

    def _publish(self) -> None:
        self._pending = None
        self._workers, self.meshes, self.stages = assemble(self._entries.values())
        self.publishes += 1
        self._on_change()

    def _publish_soon(self) -> None:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.debounce_s, self._publish)

    def _apply(self, key: bytes, value: bytes | None) -> None:
        e = parse_entry(self.keys, key, value) if value is not None else None
        if e is None:
            self._entries.pop(key, None)
        else:
            self._entries[key] = e

    async def _loop(self) -> None:
        backoff = 0.1
        while True:
            client = open_client(self.cfg, self._endpoint)
            try:
                if self._rev is None:
                    await self._relist(client)
                # (type: ignore below) aetcd ships no type information
                watch = await client.watch_prefix(self.keys.root.encode(), start_revision=self._rev + 1)  # type: ignore[operator]
                self._set_stale(False)
                self.synced.set()
                backoff = 0.1
                consume = asyncio.ensure_future(self._consume(watch))
                beat = asyncio.ensure_future(self._heartbeat(client))
                try:
                    done, _ = await asyncio.wait({consume, beat}, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        t.result()
                finally:
                    for t in (consume, beat):
                        t.cancel()
                    await asyncio.gather(consume, beat, return_exceptions=True)
            except aetcd.RevisionCompactedError:
                log.warning("watch revision %s was compacted; listing again", self._rev)
                self._rev = None
            except (aetcd.ClientError, OSError, TimeoutError) as e:
                log.warning("registry watch failed (%s: %s); resuming from revision %s",
                            type(e).__name__, e, self._rev)
                self._set_stale(True)
                self._endpoint += 1
            except Exception:  # noqa: BLE001 - anything else: say so, show stale, list everything again
                log.exception("registry watch broke; listing again")
                self._set_stale(True)
                self._rev = None
            finally:
                try:
                    await client.close()
                except Exception:  # noqa: BLE001 - a broken channel may fail to close
                    pass
            self.watch_restarts += 1
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 0.5)

    async def _relist(self, client: aetcd.Client) -> None:
        res = await client.get_prefix(self.keys.root.encode())
        self._entries = {}
        for kv in res.kvs:
            self._apply(kv.key, kv.value)
        self._rev = res.header.revision
        self.relists += 1
        if self._pending is not None:
            self._pending.cancel()
        self._publish()

    async def _consume(self, watch: aetcd.Watch) -> None:
        async for ev in watch:
            kv = ev.kv
            self._apply(kv.key, kv.value if ev.kind == aetcd.EventKind.PUT else None)
            self._rev = max(self._rev or 0, kv.mod_revision)
            self.events += 1
            self._publish_soon()
        raise aetcd.ClientError("watch ended")

    async def _heartbeat(self, client: aetcd.Client) -> None:
        """A hung etcd never breaks the watch stream: ask it something small now and then."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            async with asyncio.timeout(max(1.0, self.heartbeat_s)):
                await client.get(self.keys.root.encode() + b"~heartbeat")
