"""Worker enrollment in etcd: the library our own workers call, and `mesh register`.

An `Enrollment` puts a worker's keys (docs/protocol.md section 2) under leases kept alive by a
`LeaseKeeper`: a prefill pipeline's record under the head's lease and each stage's liveness
key under that stage's own lease; a decode engine's record under its lease. Beside an
external engine (ATOM, vLLM, SGLang) it health-checks the engine and withdraws its keys while
the engine is unhealthy. `drain()` marks the record `draining`, waits until the worker's
`GET /load` shows no work in flight (or a deadline), then deletes the keys and revokes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import aetcd
import aiohttp
import orjson

from contract.enroll import LeaseGroup, LeaseKeeper
from contract.errors import ConfigError
from contract.etcd import EtcdConfig
from contract.protocol import DecodeRecord, PrefillRecord, StageLiveness, StageRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EnrollConfig:
    ttl: int = 10
    health_path: str | None = None     # set: probe the engine and withdraw while unhealthy
    health_interval: float = 2.0
    unhealthy_after: int = 2
    drain_deadline: float = 60.0

    def __post_init__(self) -> None:
        if self.ttl < 2:
            raise ConfigError("ttl must be >= 2")
        if self.health_interval <= 0 or self.unhealthy_after < 1 or self.drain_deadline < 0:
            raise ConfigError("health_interval > 0, unhealthy_after >= 1 and drain_deadline >= 0 are required")
        if self.health_path is not None and not self.health_path.startswith("/"):
            raise ConfigError("health_path must start with '/'")


@dataclass(slots=True)
class Enrollment:
    etcd: EtcdConfig
    record: PrefillRecord | DecodeRecord | None       # None: stage liveness keys only
    stages: tuple[StageRecord, ...] = ()              # stages whose liveness this process keeps
    pipeline_id: str = ""                             # with record None: the pipeline they belong to
    cfg: EnrollConfig = EnrollConfig()
    pid: int = field(default_factory=os.getpid)
    keeper: LeaseKeeper = field(init=False)
    healthy: bool = True
    _record_group: LeaseGroup | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keeper = LeaseKeeper(self.etcd, self.cfg.ttl)
        keys = self.etcd.keys
        if self.record is None and not (self.pipeline_id and self.stages):
            raise ConfigError("a stage-only enrollment needs a pipeline id and at least one stage")
        pid_of_pipeline = self.pipeline_id
        if isinstance(self.record, PrefillRecord):
            pid_of_pipeline = self.record.id
            self._record_group = self.keeper.add("record", {keys.prefill(self.record.id): self._record_bytes()})
        elif isinstance(self.record, DecodeRecord):
            if self.stages:
                raise ConfigError("a decode engine has no stages")
            self._record_group = self.keeper.add("record", {keys.decode(self.record.id): self._record_bytes()})
        for st in self.stages:
            live = StageLiveness(pid=self.pid, host=st.host, kv_port=st.kv_port, started_at=time.time())
            self.keeper.add(f"stage-{st.pp_rank}", {keys.stage(pid_of_pipeline, st.pp_rank):
                                                    orjson.dumps(live.encode())})

    def _record_bytes(self) -> bytes:
        assert self.record is not None
        return orjson.dumps(self.record.encode())

    @property
    def url(self) -> str | None:
        return self.record.url if self.record is not None else None

    async def start(self) -> None:
        await self.keeper.start()
        self._tasks.append(asyncio.create_task(self.keeper.run(), name="lease-keepalive"))
        if self.cfg.health_path and self.url:
            self._tasks.append(asyncio.create_task(self._health_loop(), name="engine-health"))

    async def _health_loop(self) -> None:
        """Withdraw every key while the engine fails its health check; put them back after."""
        fails = 0
        to = aiohttp.ClientTimeout(total=max(1.0, self.cfg.health_interval))
        async with aiohttp.ClientSession(timeout=to) as s:
            while True:
                ok = False
                try:
                    async with s.get(f"{self.url}{self.cfg.health_path}") as r:
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                fails = 0 if ok else fails + 1
                if ok and not self.healthy:
                    log.info("engine at %s is healthy again: re-registering", self.url)
                    for g in self.keeper.groups.values():
                        await self.keeper.restore(g)
                    self.healthy = True
                elif not ok and self.healthy and fails >= self.cfg.unhealthy_after:
                    log.warning("engine at %s failed %d health checks: withdrawing it", self.url, fails)
                    for g in self.keeper.groups.values():
                        await self.keeper.withdraw(g)
                    self.healthy = False
                await asyncio.sleep(self.cfg.health_interval)

    async def set_draining(self) -> None:
        if self.record is None or self._record_group is None:
            return
        self.record = type(self.record).decode({**self.record.encode(), "draining": True})
        key = next(iter(self._record_group.entries))
        await self.keeper.put(self._record_group, key, self._record_bytes())

    async def wait_idle(self, deadline: float) -> bool:
        """Poll the worker until nothing is in flight; False if the deadline hit. Atomesh workers
        answer `GET /load`; vLLM and SGLang engines are read from their Prometheus `/metrics`
        (running plus waiting requests); an engine showing neither is given the whole deadline."""
        if not self.url:
            return True
        end = time.monotonic() + deadline
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while time.monotonic() < end:
                try:
                    busy = await self._busy(s)
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError):
                    return True  # nothing listens there any more: the worker is gone, nothing to wait for
                except (aiohttp.ClientError, TimeoutError):
                    busy = None  # a slow or broken answer is no sign of idleness (a busy CPU engine
                    #              can take seconds to answer): keep waiting, up to the deadline
                if busy == 0:
                    return True
                await asyncio.sleep(0.2)
        return False

    async def _busy(self, s: aiohttp.ClientSession) -> int | None:
        """Requests in flight or queued on the worker; None when it does not say."""
        async with s.get(f"{self.url}/load") as r:
            if r.status == 200:
                try:
                    load = orjson.loads(await r.read())
                except orjson.JSONDecodeError:
                    load = None
                # only this project's load report counts here: vLLM serves `/load` too, as
                # `{"server_load": N}`, which is no count of running and waiting requests
                if isinstance(load, dict) and type(load.get("in_flight")) is int:
                    return int(load["in_flight"]) + int(load.get("queued", 0) or 0)
        async with s.get(f"{self.url}/metrics") as r:
            return engine_busy(await r.text()) if r.status == 200 else None

    async def drain(self, deadline: float | None = None) -> bool:
        """Mark draining, wait for in-flight work, then deregister. True if it went idle in time.
        With etcd unreachable the mark is skipped (our keys go with their leases' TTL anyway)."""
        try:
            await self.set_draining()
        except aetcd.ClientError as e:
            log.warning("could not mark %s draining (etcd: %s); waiting for in-flight work anyway",
                        self.url or "this worker", e)
        idle = await self.wait_idle(self.cfg.drain_deadline if deadline is None else deadline)
        await self.close()
        return idle

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.keeper.close(revoke=True)


# running and waiting request gauges of engines without /load (vLLM, SGLang)
BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "sglang:num_running_reqs",
               "sglang:num_queue_reqs")


def engine_busy(metrics_text: str) -> int | None:
    """Sum of the busy gauges in a Prometheus text page; None if it has none of them."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUSY_GAUGES:
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return int(total) if seen else None


def parse_stage(spec: str) -> StageRecord:
    """`PP_RANK:HOST:KV_PORT:START-END` -> StageRecord."""
    try:
        rank, host, port, layers = spec.rsplit(":", 3)
        start, end = layers.split("-")
        st = StageRecord(pp_rank=int(rank), host=host, kv_port=int(port), layers=(int(start), int(end)))
    except ValueError:
        raise ConfigError(f"--stage must be PP_RANK:HOST:KV_PORT:START-END, got {spec!r}") from None
    if st.pp_rank < 0 or not 0 <= st.layers[0] < st.layers[1] or not 0 <= st.kv_port <= 65535:
        raise ConfigError(f"--stage {spec!r}: rank >= 0, 0 <= start < end, a valid port")
    return st
