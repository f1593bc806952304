"""Keys kept alive in etcd under leases: the core of worker enrollment and mesh replicas.

A `LeaseKeeper` holds groups of keys, one lease per group (a pipeline's record under the
head's lease, each stage's liveness key under that stage's own lease). It refreshes every
lease every TTL/3 with jitter; a lease found lost (expired during a long outage, revoked
behind our back) is re-granted and every key of its group re-put, never a silent
deregistration. While etcd is unreachable it keeps trying; leases survive an etcd restart.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import aetcd

from contract.errors import ConfigError
from contract.etcd import EtcdConfig, open_client

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LeaseGroup:
    name: str
    entries: dict[bytes, bytes]
    lease_id: int | None = None
    withdrawn: bool = False
    regrants: int = 0
    last_ok: float = field(default_factory=time.monotonic)


class KeyTaken(ConfigError):
    """Another live registrant holds the key (same id registered twice)."""


class LeaseKeeper:
    def __init__(self, cfg: EtcdConfig, ttl: int = 10, *, jitter: float = 0.2,
                 takeover_wait: float | None = None) -> None:
        if ttl < 2:
            raise ConfigError("ttl must be >= 2 seconds")
        if not 0 <= jitter < 1:
            raise ConfigError("jitter must be in [0, 1)")
        self.cfg, self.ttl, self.jitter = cfg, ttl, jitter
        # a key still held by a dead predecessor disappears within one TTL: wait that long
        self.takeover_wait = ttl + 2.0 if takeover_wait is None else takeover_wait
        self.groups: dict[str, LeaseGroup] = {}
        self.repairs = 0          # our keys found changed or deleted and put back
        self._client: aetcd.Client | None = None
        self._endpoint = 0
        self._lock = asyncio.Lock()

    def add(self, name: str, entries: dict[bytes, bytes]) -> LeaseGroup:
        if name in self.groups:
            raise ValueError(f"lease group {name!r} exists")
        g = self.groups[name] = LeaseGroup(name, dict(entries))
        return g

    async def client(self) -> aetcd.Client:
        if self._client is None:
            self._client = open_client(self.cfg, self._endpoint)
        return self._client

    async def _reset_client(self) -> None:
        c, self._client = self._client, None
        self._endpoint += 1
        if c is not None:
            try:
                await c.close()
            except Exception:  # noqa: BLE001 - closing a broken channel may fail in many ways
                pass

    # -- registration ---------------------------------------------------------------------

    async def start(self, deadline_s: float = 30.0) -> None:
        """Grant and put every group; keys must be free (or free up within `takeover_wait`)."""
        end = time.monotonic() + deadline_s
        for g in self.groups.values():
            while True:
                try:
                    await self._grant_and_put(g, exclusive=True)
                    break
                except aetcd.ClientError as e:
                    if time.monotonic() > end:
                        raise ConnectionError(f"etcd unreachable at {self.cfg.endpoints}: {e}") from None
                    await self._reset_client()
                    await asyncio.sleep(0.5)

    async def _grant_and_put(self, g: LeaseGroup, exclusive: bool = False) -> None:
        async with self._lock:
            c = await self.client()
            lease = await c.lease(self.ttl)
            g.lease_id = lease.id
            for key, value in g.entries.items():
                if exclusive:
                    await self._put_if_absent(c, key, value, lease.id)
                else:
                    await c.put(key, value, lease=lease.id)
            g.last_ok = time.monotonic()

    async def _put_if_absent(self, c: aetcd.Client, key: bytes, value: bytes, lease_id: int) -> None:
        end = time.monotonic() + self.takeover_wait
        while True:
            ok, _ = await c.transaction(compare=[c.transactions.create(key) == 0],
                                        success=[c.transactions.put(key, value, lease=lease_id)], failure=[])
            if ok:
                return
            if time.monotonic() > end:
                raise KeyTaken(f"{key.decode()} is registered by another live process; pick another id")
            await asyncio.sleep(0.5)

    # -- keepalive ------------------------------------------------------------------------

    async def run(self) -> None:
        """Refresh every lease every TTL/3 (with jitter) until cancelled."""
        while True:
            await asyncio.sleep(self.ttl / 3 * (1 - random.uniform(0, self.jitter)))
            for g in list(self.groups.values()):
                await self.refresh(g)

    async def refresh(self, g: LeaseGroup) -> None:
        try:
            c = await self.client()
            lost = g.lease_id is None
            if not lost:
                reply = await c.refresh_lease(g.lease_id)
                lost = reply is None or reply.TTL <= 0
            if lost:
                g.regrants += 1
                log.warning("lease of %s lost; re-granting and re-putting %d key(s)", g.name, len(g.entries))
                if g.withdrawn:
                    g.lease_id = (await c.lease(self.ttl)).id
                else:
                    await self._grant_and_put(g)
            elif not g.withdrawn:
                await self._check_keys(c, g)
            g.last_ok = time.monotonic()
        except aetcd.ClientError as e:
            log.warning("keepalive of %s failed (%s); retrying", g.name, e)
            await self._reset_client()

    async def _check_keys(self, c: aetcd.Client, g: LeaseGroup) -> None:
        """Our keys as we put them: one overwritten (another record under our id, a hijack) or deleted
        behind our back is put back, under our lease, and said so (issue 16)."""
        for key, value in list(g.entries.items()):
            got = await c.get(key)
            if got is not None and got.value == value and got.lease == g.lease_id:
                continue
            self.repairs += 1
            log.warning("registry key %s was %s behind this worker's back; putting it back", key.decode(errors="replace"),
                        "deleted" if got is None else "changed")
            await c.put(key, value, lease=g.lease_id)

    # -- changes --------------------------------------------------------------------------

    async def put(self, g: LeaseGroup, key: bytes, value: bytes) -> None:
        g.entries[key] = value
        if not g.withdrawn and g.lease_id is not None:
            await (await self.client()).put(key, value, lease=g.lease_id)

    async def withdraw(self, g: LeaseGroup) -> None:
        """Take the group's keys out of etcd (the lease stays); `restore` puts them back."""
        g.withdrawn = True
        c = await self.client()
        for key in g.entries:
            await c.delete(key)

    async def restore(self, g: LeaseGroup) -> None:
        g.withdrawn = False
        c = await self.client()
        for key, value in g.entries.items():
            await c.put(key, value, lease=g.lease_id)

    async def close(self, *, revoke: bool = True) -> None:
        """Delete our keys and revoke our leases (best effort), then drop the client."""
        if revoke and self._client is not None:
            for g in self.groups.values():
                try:
                    for key in g.entries:
                        await self._client.delete(key)
                    if g.lease_id is not None:
                        await self._client.revoke_lease(g.lease_id)
                except aetcd.ClientError as e:
                    log.warning("could not withdraw %s cleanly: %s", g.name, e)
        await self._reset_client()
