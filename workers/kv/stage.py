"""KV service of one engine process: its pools registered with a transport, and (prefill stages)
the side-channel server that writes its layers into consumer ranks on `write_request`."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from contract.protocol import ConsumerRank, WriteRequest
from workers.engine.kv_cache import KVPool
from workers.kv.sidechannel import Holder, StageChannel, worker_token
from workers.kv.transport import Layout, Transport, copy_plan, create


def pool_layout(pool: KVPool) -> Layout:
    t = pool.layers[0]
    return Layout(kv_heads=t.shape[2], block_size=t.shape[3], head_dim=t.shape[4], elem=t.element_size())


def layout_extra(pool: KVPool) -> dict[str, int]:
    lay = pool_layout(pool)
    return {"block_size": lay.block_size, "head_dim": lay.head_dim, "elem": lay.elem}


@dataclass(slots=True)
class KVEndpoint:
    """What peers need to reach this process's pools."""
    transport: Transport
    regions: list[int]          # base address of each local layer's pool
    layout: Layout
    num_blocks: int = 0


def register_pool(pool: KVPool, backend: str, host: str) -> KVEndpoint:
    t = create(backend, host)
    return KVEndpoint(t, t.register(pool.layers), pool_layout(pool), int(pool.layers[0].shape[0]))


def make_writer(ep: KVEndpoint, layer_start: int, layer_end: int, head0: int = 0) -> Any:
    """The producer's writer: its layers (a PP stage's, or all of a TP prefill rank's, whose pools
    hold heads from `head0`), sliced to each consumer rank's heads, in one batched write."""
    async def write(req: WriteRequest, rank: ConsumerRank) -> None:
        lay = req.extra.get("layout") or {}
        dst = Layout(kv_heads=rank.head_end - rank.head_start, block_size=int(lay.get("block_size", 0)),
                     head_dim=int(lay.get("head_dim", 0)), elem=int(lay.get("elem", 0)))
        if any(not 0 <= b < ep.num_blocks for b in req.src_block_ids):
            raise ValueError(f"source block ids outside this stage's pool of {ep.num_blocks}")
        if len(rank.region_addrs) < layer_end:
            raise ValueError(f"consumer rank {rank.tp_rank} lists {len(rank.region_addrs)} layers; "
                             f"this stage needs up to layer {layer_end}")
        plan = copy_plan(ep.regions, ep.layout, list(rank.region_addrs[layer_start:layer_end]), dst,
                         rank.head_start, rank.head_end, list(req.src_block_ids), list(req.dst_block_ids), head0)
        if plan[0]:  # a TP producer may hold none of this rank's heads: nothing to move, still done
            await asyncio.to_thread(ep.transport.write, rank.segment, *plan)
    return write


def start_stage_thread(ep: KVEndpoint, host: str, pp_rank: int, layer_start: int, layer_end: int,
                       holder: Holder | None = None, head0: int = 0,
                       grant_key: bytes | None = None) -> tuple[int, asyncio.AbstractEventLoop]:
    """Run a stage's side-channel server on its own thread and loop; returns its kv port and that
    loop (the stage's etcd enrollment runs there too)."""
    ready: list[tuple[int, asyncio.AbstractEventLoop]] = []
    ev = threading.Event()

    async def serve() -> None:
        ch = StageChannel(host=host, port=0, pp_rank=pp_rank, holder=holder,
                          writer=make_writer(ep, layer_start, layer_end, head0), grant_key=grant_key,
                          token=worker_token())
        await ch.start()
        ready.append((ch.port, asyncio.get_running_loop()))
        ev.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), name=f"kv-stage-{pp_rank}", daemon=True).start()
    if not ev.wait(30):
        raise RuntimeError("stage side channel did not start")
    return ready[0]


# -- what the HTTP adapters need from an engine's KV side ---------------------------------------

Unit = tuple[int, tuple[int, int], int]          # (producer rank, layers [start, end), first KV head)


class ProducerKV(Protocol):
    """A prefill engine's KV side as the prefill adapter sees it: which producers it has, which of
    them serve from this process (the adapter runs their side channels) and with what writer."""
    backend: str | None
    tp_size: int

    def units(self) -> list[Unit]: ...

    def local_writers(self) -> dict[int, Any]: ...   # producer rank -> writer, for the ranks served here

    def remote_port(self, rank: int) -> int: ...       # side-channel port of a producer served elsewhere

    def grant(self, transfer_id: str, blocks: tuple[int, ...]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ConsumerKV(Protocol):
    """A decode engine's KV side as the decode adapter sees it: its ranks and what a pull carries."""

    def ranks(self) -> tuple[ConsumerRank, ...]: ...

    def pull_extra(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class EngineProducerKV:
    """A real PP / TP-producer engine: stage 0's (rank 0's) pool registered with a transport here;
    the other stages serve from their own processes (their ports are in the rank infos)."""

    def __init__(self, engine: Any, backend: str, host: str) -> None:
        self.engine = engine
        self.backend: str | None = backend
        self.tp_size = int(getattr(engine, "tp_size", 1))
        assert engine.pool is not None
        self.endpoint = register_pool(engine.pool, backend, host)

    def units(self) -> list[Unit]:
        return list(self.engine.producer_units())

    def local_writers(self) -> dict[int, Any]:
        r, (a, b), head0 = self.units()[0]
        return {r: make_writer(self.endpoint, a, b, head0)}

    def remote_port(self, rank: int) -> int:
        assert self.engine.ranks is not None
        return int(self.engine.ranks.infos[rank]["kv_port"])

    def grant(self, transfer_id: str, blocks: tuple[int, ...]) -> dict[str, Any]:
        from workers.engine.ctrl import kv_grant

        ranks = getattr(self.engine, "ranks", None)
        return {"kv_grant": kv_grant(ranks.secret, transfer_id, blocks)} if ranks is not None else {}

    def close(self) -> None:
        self.endpoint.transport.close()


class EngineConsumerKV:
    """A real TP decode engine: rank 0's pool registered here, the other ranks' segments and
    regions from their infos."""

    def __init__(self, engine: Any, backend: str, host: str) -> None:
        self.engine = engine
        assert engine.pool is not None
        self.endpoint = register_pool(engine.pool, backend, host)
        self.layout = layout_extra(engine.pool)

    def ranks(self) -> tuple[ConsumerRank, ...]:
        out = []
        tp = self.engine
        for r in range(tp.tp_size):
            a, b = tp.head_range(r)
            if r == 0:
                seg, regions = self.endpoint.transport.segment, self.endpoint.regions
            else:
                assert tp.ranks is not None
                info = tp.ranks.infos[r]
                seg, regions = info["segment"], info["regions"]
            out.append(ConsumerRank(tp_rank=r, segment=seg, head_start=a, head_end=b, region_addrs=tuple(regions)))
        return tuple(out)

    def pull_extra(self) -> dict[str, Any]:
        return {"layout": self.layout}

    def close(self) -> None:
        self.endpoint.transport.close()
