"""`mesh prefill` and `mesh decode`: build the engine, serve the adapter, enroll in etcd, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from contract.clikit import settle_gc
from contract.errors import ConfigError
from contract.etcd import EtcdConfig
from contract.protocol import OWN_CAPABILITIES, DecodeRecord, PrefillRecord, RankRecord, StageRecord
from workers import rank_hooks
from workers.engine.config import EngineConfig
from workers.faults import Faults
from workers.kv.sidechannel import WORKER_TOKEN_ENV, worker_token
from workers.register import EnrollConfig, Enrollment

log = logging.getLogger(__name__)


def opaque_id(role: str, host: str, port: int) -> str:
    """A worker's default id: stable for its address, but not the address (ids show in /metrics, logs
    and the registry's keys; addresses only in the records)."""
    import hashlib

    return f"{role}-{hashlib.sha256(f'{host}:{port}'.encode()).hexdigest()[:12]}"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What `mesh prefill` / `mesh decode` serve, as the CLI built it from its flags (checked there)."""
    role: str                         # "prefill" | "decode"
    checkpoint: str
    model: str                        # served model name
    host: str = "127.0.0.1"           # every listener of the worker binds here
    port: int = 0
    id: str = ""                      # "": an opaque id from the bound address
    kv_backend: str = "mooncake"
    pp_size: int = 1                  # prefill: stage processes
    tp_size: int = 1                  # decode: rank processes; prefill: TP ranks (then pp_size 1)
    partition: str | None = None      # prefill: layers per stage
    remote_stages: int | None = None  # prefill: the port remote stages join on
    kv_ttl: float = 120.0             # prefill: seconds a transfer is held without release
    pull_deadline: float = 30.0       # decode: seconds a KV pull may take before kv_transfer_failed
    lease_ttl: int = 10               # etcd lease
    devices: tuple[str, ...] = ("cpu",)   # one per stage / rank
    engine: EngineConfig = EngineConfig()   # of stage 0 / rank 0 (its device: devices[0])
    faults: Faults | None = None      # injected on purpose (chaos testing)
    etcd: EtcdConfig | None = None

    @property
    def tp_prefill(self) -> bool:
        return self.role == "prefill" and self.tp_size > 1


def devices(spec: str, world: int) -> tuple[str, ...]:
    """`--device D` (every rank on D) or `--device D0,D1,...` (one per stage / rank)."""
    devs = [d.strip() for d in spec.split(",") if d.strip()] or ["cpu"]
    if len(devs) == 1:
        return tuple(devs * world)
    if len(devs) != world:
        raise ConfigError(f"--device: give one device, or one per stage/rank ({world}); got {len(devs)}")
    return tuple(devs)


def worker_config(role: str, a: Any, etcd: EtcdConfig | None) -> WorkerConfig:
    """The CLI's flags (an argparse namespace) as a checked `WorkerConfig`."""
    faults = None
    if a.inject_faults:
        try:
            faults = Faults.from_json(json.loads(a.inject_faults))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--inject-faults: {e}") from None
    pp_size = getattr(a, "pp_size", 1)
    remote = getattr(a, "remote_stages", None)
    tp_prefill = role == "prefill" and a.tp_size > 1
    if tp_prefill and (pp_size > 1 or remote):
        raise ConfigError("a prefill pipeline is PP x TP1 or TP x PP1: give --pp-size or --tp-size, not both")
    devs = devices(str(a.device), pp_size if role == "prefill" and not tp_prefill else a.tp_size)
    try:
        eng = EngineConfig(block_size=a.block_size, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                           max_batch_tokens=a.max_batch_tokens, dtype=a.dtype, device=devs[0])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if getattr(a, "pull_deadline", 30.0) <= 0:
        raise ConfigError("--pull-deadline must be > 0 seconds")
    if a.kv_backend == "cuda-ipc" and (remote or not all(d.startswith("cuda") for d in devs)):
        raise ConfigError("--kv-backend cuda-ipc moves KV between GPUs of one host: every stage and rank needs "
                          "a cuda --device, and no remote stages")
    return WorkerConfig(role=role, checkpoint=a.checkpoint, model=a.model or Path(a.checkpoint).name, host=a.host,
                        port=a.port, id=a.id or "", kv_backend=a.kv_backend, pp_size=pp_size, tp_size=a.tp_size,
                        partition=getattr(a, "partition", None), remote_stages=remote,
                        kv_ttl=getattr(a, "kv_ttl", 120.0), pull_deadline=getattr(a, "pull_deadline", 30.0),
                        lease_ttl=a.ttl, devices=devs, engine=eng,
                        faults=faults, etcd=etcd)


async def _on_stop(stop: asyncio.Event, cancel: threading.Event) -> None:
    await stop.wait()
    cancel.set()


async def serve_worker(c: WorkerConfig, stop: asyncio.Event) -> int:
    """Serve until `stop`; the exit status: 0, or 3 when a remote stage was lost (its supervisor
    restarts the pipeline)."""
    try:
        token = worker_token()   # checked before any engine process starts (its stages read it too)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    role, model, cfg, devs, faults, etcd = c.role, c.model, c.engine, list(c.devices), c.faults, c.etcd
    tp_prefill = c.tp_prefill
    if role == "prefill":
        from workers.engine.pp import PPEngine
        from workers.engine.tp import TPEngine
        from workers.prefill import PrefillServer

        if tp_prefill:  # each TP rank serves its slice of the KV heads, of every layer
            engine: Any = TPEngine(c.checkpoint, cfg, c.tp_size, kv_backend=c.kv_backend, kv_host=c.host,
                                   devices=devs, producer=True, rank_startup=rank_hooks.startup)
        elif c.remote_stages:  # the wait for the stages runs in a thread, so SIGTERM (stop) ends it
            cancel = threading.Event()
            heard = asyncio.create_task(_on_stop(stop, cancel))
            try:
                engine = await asyncio.to_thread(PPEngine, c.checkpoint, cfg, c.pp_size, c.partition,
                                                 kv_backend=c.kv_backend, kv_host=c.host,
                                                 remote_port=c.remote_stages, devices=devs, cancel=cancel,
                                                 rank_startup=rank_hooks.startup)
            finally:
                heard.cancel()
        else:
            engine = PPEngine(c.checkpoint, cfg, c.pp_size, c.partition, kv_backend=c.kv_backend, kv_host=c.host,
                              devices=devs, rank_startup=rank_hooks.startup)
        wid = c.id or opaque_id("prefill", c.host, c.port)
        server: Any = PrefillServer(engine, model, wid, kv_backend=c.kv_backend, host=c.host, ttl_s=c.kv_ttl,
                                    token=token)
    else:
        from workers.decode import DecodeServer
        from workers.engine.tp import TPEngine

        engine = TPEngine(c.checkpoint, cfg, c.tp_size, kv_backend=c.kv_backend, kv_host=c.host, devices=devs,
                          rank_startup=rank_hooks.startup)
        wid = c.id or opaque_id("decode", c.host, c.port)
        server = DecodeServer(engine, model, wid, kv_backend=c.kv_backend, host=c.host, token=token,
                              pull_deadline_s=c.pull_deadline)
    if faults is not None:
        log.warning("%s injects faults on purpose: %s", wid, faults)
    # torch, the model and the engine stay for good, out of the collector's sight: a full
    # collection over torch alone takes ~80 ms here, a stall of every sequence's next token (issue 19)
    settle_gc()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    if faults is not None:
        server.faults = faults
    site = web.TCPSite(runner, c.host, c.port, reuse_address=True)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
    url = f"http://{c.host}:{port}"
    if not c.id:
        wid = server.id = opaque_id(role, c.host, port)
    enrollment = None
    if etcd is not None:
        if role == "prefill":
            stages = tuple(StageRecord(pp_rank=s.pp_rank, host=s.host, kv_port=s.port, layers=s.layers)
                           for s in server.stage_addrs())
            record: Any = PrefillRecord(id=wid, model=model, url=url, pp_size=len(stages),
                                        tp_size=c.tp_size if tp_prefill else 1, block_size=cfg.block_size,
                                        num_blocks=cfg.num_blocks, kv_backend=c.kv_backend, stages=stages,
                                        capabilities=OWN_CAPABILITIES, api_key_env=WORKER_TOKEN_ENV if token else "")
        else:
            stages = ()
            record = DecodeRecord(id=wid, model=model, url=url, tp_size=c.tp_size, block_size=cfg.block_size,
                                  num_blocks=cfg.num_blocks, kv_backend=c.kv_backend, capabilities=OWN_CAPABILITIES,
                                  api_key_env=WORKER_TOKEN_ENV if token else "",
                                  ranks=tuple(RankRecord(tp_rank=r.tp_rank, host=c.host, segment=r.segment)
                                              for r in server.ranks()))
        own = stages[:1] if role == "prefill" else ()   # stage 0 lives here; the others enroll themselves
        enrollment = Enrollment(etcd=etcd, record=record, stages=own, cfg=EnrollConfig(ttl=c.lease_ttl))
        await enrollment.start()
        for st in stages[1:]:
            answer = await asyncio.to_thread(engine.ranks.request, st.pp_rank, "enroll", etcd, wid, st, c.lease_ttl)
            if answer != "ok":
                raise RuntimeError(f"stage {st.pp_rank} could not enroll: {answer}")
    print(f"{role} {url}", flush=True)
    print("ready", flush=True)
    watch = asyncio.create_task(_watch_ranks(engine, server, enrollment, stop))
    try:
        await stop.wait()
        if enrollment is not None:  # a broken engine has nothing to drain: just leave
            await (enrollment.close() if server.failed else enrollment.drain())
    finally:
        watch.cancel()
        await runner.cleanup()
    return 3 if watch.done() and not watch.cancelled() and watch.result() else 0


async def _watch_ranks(engine: Any, server: Any, enrollment: Enrollment | None, stop: asyncio.Event) -> bool:
    """A stage or rank process that dies takes the worker out: health 503, liveness withdrawn.
    With remote stages the head then exits (status 3), so its supervisor restarts the pipeline."""
    while True:
        await asyncio.sleep(0.5)
        ranks = getattr(engine, "ranks", None)
        why = ranks.dead() if ranks is not None else None
        if why and not server.failed:
            server.failed = why
            log.error("%s: withdrawing this worker", why)
            if enrollment is not None:
                for g in enrollment.keeper.groups.values():
                    await enrollment.keeper.withdraw(g)
            if ranks is not None and ranks.remote:   # the head exits non-zero: its supervisor restarts the pipeline
                stop.set()
                return True
