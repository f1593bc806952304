"""Multi-process engines: rank 0 in the caller's process, ranks 1..n-1 spawned.

Each spawned rank is a named process that builds its slice of the model (its PP layers or its
TP shard), acks when ready, then serves commands from rank 0 over a ZMQ PAIR socket (batch
metadata, KV reads and writes, stop). Tensors between ranks (PP hidden states, logits back
to rank 0, TP all-reduce) go over a gloo process group of its own (`ProcessGroupGloo` on a
`TCPStore`), so several engines can live in one process without a global default group.
A rank that dies is reported (`RankDied`) rather than waited on forever.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import multiprocessing as mp
import pickle
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from workers.engine.checkpoint import load_weights
from workers.engine.config import EngineConfig, ModelConfig, Parallel
from workers.engine.kv_cache import KVPool
from workers.engine.model import LlamaStage

log = logging.getLogger(__name__)
TIMEOUT = datetime.timedelta(seconds=60)


class RankDied(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_group(rank: int, world: int, port: int) -> Any:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(store, rank, world, TIMEOUT)


def all_reduce_fn(group: Any):  # type: ignore[no-untyped-def]
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        group.allreduce([t]).wait()
        return t
    return reduce


@dataclass(frozen=True, slots=True)
class RankSpec:
    kind: str               # "tp" | "pp"
    checkpoint: str
    engine: EngineConfig
    par: Parallel
    rank: int
    world: int
    store_port: int
    ctrl_port: int
    kv_backend: str | None = None     # set: register the pools, serve KV (pp stages) and report how
    kv_host: str = "127.0.0.1"


def _rank_main(spec: RankSpec, ready: Any) -> None:
    """A spawned rank: build, ack, serve commands until `stop`."""
    try:
        torch.set_num_threads(1)
        mc = ModelConfig.load(spec.checkpoint)
        group = make_group(spec.rank, spec.world, spec.store_port)
        weights = load_weights(spec.checkpoint, mc, spec.par, spec.engine.torch_dtype)
        model = LlamaStage(mc, spec.par, weights, all_reduce_fn(group) if spec.kind == "tp" else None)
        pool = KVPool(len(model.layer_ids), spec.engine.num_blocks, model.kv_heads, spec.engine.block_size,
                      mc.head_dim, spec.engine.torch_dtype)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(f"tcp://127.0.0.1:{spec.ctrl_port}")
    except Exception:  # noqa: BLE001 - reported to the parent, which fails clearly
        ready.put(("error", traceback.format_exc()))
        return
    info: dict[str, Any] = {}
    kv_loop = None
    enrollment = None
    if spec.kv_backend:
        try:
            from workers.kv.stage import register_pool, start_stage_thread

            ep = register_pool(pool, spec.kv_backend, spec.kv_host)
            info = {"segment": ep.transport.segment, "regions": ep.regions}
            if spec.kind == "pp":
                info["kv_port"], kv_loop = start_stage_thread(ep, spec.kv_host, spec.par.pp_rank,
                                                              spec.par.layer_start, spec.par.layer_end)
        except Exception:  # noqa: BLE001 - reported to the parent
            ready.put(("error", traceback.format_exc()))
            return
    ready.put(("ready", spec.rank, info))
    dtype = spec.engine.torch_dtype
    while True:
        cmd, *args = pickle.loads(sock.recv())
        if cmd == "stop":
            if enrollment is not None and kv_loop is not None:  # deregister this stage's liveness
                try:
                    asyncio.run_coroutine_threadsafe(enrollment.close(), kv_loop).result(10)
                except Exception:  # noqa: BLE001 - its lease expires anyway
                    pass
            break
        if cmd == "enroll":  # this stage's own liveness key, under its own lease, kept by this process
            try:
                if kv_loop is None:
                    raise RuntimeError("enroll needs a stage with a KV side channel")
                from workers.register import EnrollConfig, Enrollment

                etcd_cfg, pipeline_id, stage_rec, ttl = args
                enrollment = Enrollment(etcd=etcd_cfg, record=None, stages=(stage_rec,), pipeline_id=pipeline_id,
                                        cfg=EnrollConfig(ttl=ttl))
                asyncio.run_coroutine_threadsafe(enrollment.start(), kv_loop).result(60)
                sock.send(pickle.dumps("ok"))
            except Exception as e:  # noqa: BLE001 - told to rank 0, which fails its start clearly
                sock.send(pickle.dumps(f"error: {e}"))
            continue
        if cmd == "forward":
            batch, ids = args
            if spec.kind == "tp":
                model.forward(batch, pool, input_ids=ids)
            else:  # pp: hidden from the previous stage, to the next (or logits to stage 0)
                hidden = torch.empty(len(batch.positions), mc.hidden_size, dtype=dtype)
                group.recv([hidden], spec.rank - 1, 0).wait()
                out = model.forward(batch, pool, hidden=hidden).contiguous()
                group.send([out], (spec.rank + 1) % spec.world, 0).wait()
        elif cmd == "write_kv":  # (local layer, block ids, kv [n, 2, kvh, bs, hd])
            layer, blocks, kv = args
            pool.layers[layer][torch.tensor(blocks)] = kv.to(dtype)
        elif cmd == "read_kv":
            layer, blocks = args
            sock.send(pickle.dumps(pool.layers[layer][torch.tensor(blocks)].clone()))
        elif cmd == "ping":
            sock.send(pickle.dumps("pong"))
    sock.close(0)
    ctx.term()


class Ranks:
    """Rank 0's side: spawns ranks 1..world-1, holds rank 0's group and their control sockets."""

    def __init__(self, kind: str, checkpoint: str | Path, engine: EngineConfig, pars: list[Parallel],
                 start_timeout: float = 120.0, kv_backend: str | None = None, kv_host: str = "127.0.0.1") -> None:
        self.kind = kind
        self.world = len(pars)
        store_port = free_port()
        mpctx = mp.get_context("spawn")
        self._ready = mpctx.Queue()
        self._zctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.procs: list[Any] = []
        for r in range(1, self.world):
            s = self._zctx.socket(zmq.PAIR)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 500)
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.socks.append(s)
            spec = RankSpec(kind, str(checkpoint), engine, pars[r], r, self.world, store_port, port,
                            kv_backend, kv_host)
            p = mpctx.Process(target=_rank_main, args=(spec, self._ready), name=f"atomesh-{kind}-rank{r}",
                              daemon=True)
            p.start()
            self.procs.append(p)
        self.group = make_group(0, self.world, store_port)
        self.infos: dict[int, dict[str, Any]] = {}
        for _ in range(1, self.world):
            try:
                status, *info = self._ready.get(timeout=start_timeout)
            except Exception:  # noqa: BLE001 - queue.Empty
                self.close()
                raise RankDied(f"a {kind} rank did not start within {start_timeout}s") from None
            if status != "ready":
                self.close()
                raise RankDied(f"a {kind} rank failed to start:\n{info[0]}")
            self.infos[info[0]] = info[1]

    def check(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                raise RankDied(f"{p.name} died with exit code {p.exitcode}")

    def _send(self, s: zmq.Socket, data: bytes) -> None:
        """A PAIR socket blocks a send while its peer is gone: wait in slices, checking the ranks."""
        while True:
            self.check()
            try:
                s.send(data)
                return
            except zmq.Again:
                continue

    def send(self, rank: int, *msg: Any) -> None:
        self._send(self.socks[rank - 1], pickle.dumps(msg))

    def broadcast(self, *msg: Any) -> None:
        data = pickle.dumps(msg)
        for s in self.socks:
            self._send(s, data)

    def request(self, rank: int, *msg: Any, timeout_ms: int = 60000) -> Any:
        self.send(rank, *msg)
        s = self.socks[rank - 1]
        if not s.poll(timeout_ms):
            self.check()
            raise RankDied(f"rank {rank} did not answer {msg[0]!r}")
        return pickle.loads(s.recv())

    def close(self) -> None:
        for s, p in zip(self.socks, self.procs):
            if p.is_alive():
                try:
                    s.send(pickle.dumps(("stop",)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for s in self.socks:
            s.close(0)
        self.socks.clear()
        self._zctx.term()
        self._ready.close()
        self._ready.join_thread()
