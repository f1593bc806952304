"""`mesh prefill` and `mesh decode`: build the engine, serve the adapter, enroll in etcd, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from mesh.errors import ConfigError
from mesh.etcd import EtcdConfig
from mesh.protocol import OWN_CAPABILITIES, DecodeRecord, PrefillRecord, RankRecord, StageRecord
from workers.engine.config import EngineConfig
from workers.kv.sidechannel import WORKER_TOKEN_ENV, worker_token
from workers.register import EnrollConfig, Enrollment

log = logging.getLogger(__name__)


def opaque_id(role: str, host: str, port: int) -> str:
    """A worker's default id: stable for its address, but not the address (ids show in /metrics, logs
    and the registry's keys; addresses only in the records)."""
    import hashlib

    return f"{role}-{hashlib.sha256(f'{host}:{port}'.encode()).hexdigest()[:12]}"


def devices(a: Any, world: int) -> list[str]:
    """`--device D` (every rank on D) or `--device D0,D1,...` (one per stage / rank)."""
    devs = [d.strip() for d in str(getattr(a, "device", "cpu")).split(",") if d.strip()]
    if len(devs) == 1:
        return devs * world
    if len(devs) != world:
        raise ConfigError(f"--device: give one device, or one per stage/rank ({world}); got {len(devs)}")
    return devs


def engine_config(a: Any, device: str = "cpu") -> EngineConfig:
    return EngineConfig(block_size=a.block_size, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
                        max_batch_tokens=a.max_batch_tokens, dtype=a.dtype, device=device)


async def _on_stop(stop: asyncio.Event, cancel: threading.Event) -> None:
    await stop.wait()
    cancel.set()


async def serve_worker(role: str, a: Any, stop: asyncio.Event, etcd: EtcdConfig | None) -> None:
    model = a.model or Path(a.checkpoint).name
    try:
        token = worker_token()   # checked before any engine process starts (its stages read it too)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    faults = None
    if getattr(a, "inject_faults", None):  # checked before any engine process starts
        from workers.server import Faults

        try:
            faults = Faults.from_json(json.loads(a.inject_faults))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--inject-faults: {e}") from None
    tp_prefill = role == "prefill" and a.tp_size > 1
    if tp_prefill and (a.pp_size > 1 or a.remote_stages):
        raise ConfigError("a prefill pipeline is PP x TP1 or TP x PP1: give --pp-size or --tp-size, not both")
    devs = devices(a, a.pp_size if role == "prefill" and not tp_prefill else a.tp_size)
    cfg = engine_config(a, devs[0])
    if role == "prefill":
        from workers.engine.pp import PPEngine
        from workers.engine.tp import TPEngine
        from workers.prefill import PrefillServer

        if tp_prefill:  # each TP rank serves its slice of the KV heads, of every layer
            engine: Any = TPEngine(a.checkpoint, cfg, a.tp_size, kv_backend=a.kv_backend, kv_host=a.host,
                                   devices=devs, producer=True)
        elif a.remote_stages:  # the wait for the stages runs in a thread, so SIGTERM (stop) ends it
            cancel = threading.Event()
            heard = asyncio.create_task(_on_stop(stop, cancel))
            try:
                engine = await asyncio.to_thread(PPEngine, a.checkpoint, cfg, a.pp_size, a.partition,
                                                 kv_backend=a.kv_backend, kv_host=a.host,
                                                 remote_port=a.remote_stages, devices=devs, cancel=cancel)
            finally:
                heard.cancel()
        else:
            engine = PPEngine(a.checkpoint, cfg, a.pp_size, a.partition, kv_backend=a.kv_backend, kv_host=a.host,
                              devices=devs)
        wid = a.id or opaque_id("prefill", a.host, a.port)
        server: Any = PrefillServer(engine, model, wid, kv_backend=a.kv_backend, host=a.host, ttl_s=a.kv_ttl,
                                    token=token)
    else:
        from workers.decode import DecodeServer
        from workers.engine.tp import TPEngine

        engine = TPEngine(a.checkpoint, cfg, a.tp_size, kv_backend=a.kv_backend, kv_host=a.host, devices=devs)
        wid = a.id or opaque_id("decode", a.host, a.port)
        server = DecodeServer(engine, model, wid, kv_backend=a.kv_backend, host=a.host, token=token)
    if faults is not None:
        log.warning("%s injects faults on purpose: %s", wid, faults)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    if faults is not None:
        server.faults = faults
    site = web.TCPSite(runner, a.host, a.port, reuse_address=True)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://{a.host}:{port}"
    if not a.id:
        wid = server.id = opaque_id(role, a.host, port)
    enrollment = None
    if etcd is not None:
        if role == "prefill":
            stages = tuple(StageRecord(pp_rank=s.pp_rank, host=s.host, kv_port=s.port, layers=s.layers)
                           for s in server.stage_addrs())
            record: Any = PrefillRecord(id=wid, model=model, url=url, pp_size=len(stages),
                                        tp_size=a.tp_size if tp_prefill else 1, block_size=cfg.block_size,
                                        num_blocks=cfg.num_blocks, kv_backend=a.kv_backend, stages=stages,
                                        capabilities=OWN_CAPABILITIES, api_key_env=WORKER_TOKEN_ENV if token else "")
        else:
            stages = ()
            record = DecodeRecord(id=wid, model=model, url=url, tp_size=a.tp_size, block_size=cfg.block_size,
                                  num_blocks=cfg.num_blocks, kv_backend=a.kv_backend, capabilities=OWN_CAPABILITIES,
                                  api_key_env=WORKER_TOKEN_ENV if token else "",
                                  ranks=tuple(RankRecord(tp_rank=r.tp_rank, host=a.host, segment=r.segment)
                                              for r in server.ranks()))
        own = stages[:1] if role == "prefill" else ()   # stage 0 lives here; the others enroll themselves
        enrollment = Enrollment(etcd=etcd, record=record, stages=own, cfg=EnrollConfig(ttl=a.ttl))
        await enrollment.start()
        for st in stages[1:]:
            answer = await asyncio.to_thread(engine.ranks.request, st.pp_rank, "enroll", etcd, wid, st, a.ttl)
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


async def _watch_ranks(engine: Any, server: Any, enrollment: Enrollment | None, stop: asyncio.Event) -> None:
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
            if ranks.remote:
                EXIT["code"] = 3
                stop.set()


EXIT = {"code": 0}  # set when the worker must exit non-zero (a remote stage was lost)
