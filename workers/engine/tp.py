"""TP decode engine: `tp_size` rank processes, KV heads split across ranks, all-reduce over gloo.

Rank r holds attention heads [r*H/tp, (r+1)*H/tp), KV heads [r*KV/tp, (r+1)*KV/tp) of every
layer (column-parallel q/k/v and gate/up, row-parallel o and down, an all-reduce after each).
Rank 0 (this process) schedules and samples; every step it sends the batch to the others.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.engine.config import EngineConfig, Parallel
from workers.engine.dist import Ranks
from workers.engine.engine import Engine
from workers.engine.group import all_reduce_fn
from workers.engine.model import ForwardBatch
from workers.engine.rank import RankStartup


class TPEngine(Engine):
    def __init__(self, checkpoint: str | Path, cfg: EngineConfig, tp_size: int, kv_backend: str | None = None,
                 kv_host: str = "127.0.0.1", devices: list[str] | None = None, producer: bool = False,
                 rank_startup: RankStartup | None = None) -> None:
        """`producer`: a TP prefill engine, each rank serving its KV heads to decode engines.
        `rank_startup`: what each spawned rank runs once built (its KV side; `workers/` gives it)."""
        if tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        self.tp_size = tp_size
        pars = [Parallel(tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        self.ranks = Ranks("tp", checkpoint, cfg, pars, kv_backend=kv_backend, kv_host=kv_host,
                           devices=devices, producer=producer, startup=rank_startup) if tp_size > 1 else None
        try:
            super().__init__(checkpoint, cfg, pars[0],
                             all_reduce=all_reduce_fn(self.ranks.group, self.ranks.wire.direct) if self.ranks else None)
        except BaseException:
            self.close()
            raise

    def _local_forward(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ranks is not None:  # the host batch to the other ranks; each moves it to its device
            self.ranks.broadcast("forward", batch, input_ids)
        return super()._local_forward(batch, input_ids)

    def producer_units(self) -> list[tuple[int, tuple[int, int], int]]:
        """What each rank serves as a KV producer: (rank, layers [start, end), first KV head)."""
        layers = (0, self.model_cfg.num_hidden_layers)
        return [(r, layers, self.head_range(r)[0]) for r in range(self.tp_size)]

    def head_range(self, rank: int) -> tuple[int, int]:
        per = self.model_cfg.num_key_value_heads // self.tp_size
        return rank * per, (rank + 1) * per

    def write_kv(self, layer: int, blocks: list[int], kv: torch.Tensor) -> None:
        """Land KV of all heads (kv: [n, 2, kv_heads, bs, hd]) in every rank's slice of `blocks`."""
        for r in range(self.tp_size):
            a, b = self.head_range(r)
            part = kv[:, :, a:b].contiguous()
            if r == 0:
                assert self.pool is not None
                dst = self.pool.layers[layer]
                dst[torch.tensor(blocks, device=dst.device)] = part.to(device=dst.device, dtype=dst.dtype)
            else:
                assert self.ranks is not None
                self.ranks.send(r, "write_kv", layer, blocks, part.cpu())
        if self.ranks is not None:
            for r in range(1, self.tp_size):  # writes are ordered; a ping makes them visible before use
                self.ranks.request(r, "ping")

    def close(self) -> None:
        ranks = getattr(self, "ranks", None)
        if ranks is not None:
            ranks.close()
            self.ranks = None
