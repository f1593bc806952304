"""PP stage engine: `pp_size` stage processes, each building only its layers.

Stage 0 (this process) owns the scheduler and the block table; every stage's pool is indexed
by the same block ids. Per micro-batch stage 0 sends the batch metadata to every stage (ZMQ),
runs its layers and sends the hidden states to stage 1 (gloo); each stage passes them on; the
last stage sends the logits of the rows to sample back to stage 0, which samples (sampling
stays where the per-request generators live).
Up to `pp_size` micro-batches are in flight: stage 0 schedules the next one (from sequences
not already in flight) while later stages work on earlier ones; every stage handles them in
order, so KV a micro-batch writes is there before a later one reads it.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import torch

from workers.engine.config import EngineConfig, ModelConfig, Parallel, partition
from workers.engine.dist import Ranks
from workers.engine.engine import Engine, StepOutput, build_batch
from workers.engine.rank import RankStartup
from workers.engine.scheduler import Work


class PPEngine(Engine):
    def __init__(self, checkpoint: str | Path, cfg: EngineConfig, pp_size: int,
                 layer_partition: str | None = None, kv_backend: str | None = None, kv_host: str = "127.0.0.1",
                 remote_port: int | None = None, devices: list[str] | None = None, cancel: Any = None,
                 rank_startup: RankStartup | None = None) -> None:
        """`rank_startup`: what each spawned stage runs once built (its KV side; `workers/` gives it)."""
        mc = ModelConfig.load(checkpoint)
        self.parts = partition(mc.num_hidden_layers, pp_size, layer_partition)
        pars = [Parallel(pp_rank=r, pp_size=pp_size, layer_start=a, layer_end=b)
                for r, (a, b) in enumerate(self.parts)]
        self.pp_size = pp_size
        self.inflight: deque[tuple[list[Work], int, Any, torch.Tensor]] = deque()
        self.max_inflight = 0
        self.ranks = Ranks("pp", checkpoint, cfg, pars, kv_backend=kv_backend, kv_host=kv_host,
                           remote_port=remote_port, bind_host=kv_host, start_timeout=600.0 if remote_port else 120.0,
                           devices=devices, cancel=cancel, startup=rank_startup) if pp_size > 1 else None
        try:
            super().__init__(checkpoint, cfg, pars[0])
        except BaseException:
            self.close()
            raise

    def step(self) -> list[StepOutput]:
        if self.ranks is None:
            return super().step()
        out = self._rejections()
        # fill the pipeline: up to pp_size micro-batches, none sharing a sequence
        while len(self.inflight) < self.pp_size:
            busy = frozenset(w.seq.id for mb, _, _, _ in self.inflight for w in mb)
            work = self.scheduler.schedule(busy)
            if not work:
                break
            self.inflight.append(self._launch(work))
            self.max_inflight = max(self.max_inflight, len(self.inflight))
        if not self.inflight:
            return out
        work, n, send, _ = self.inflight.popleft()
        assert self.ranks is not None
        logits = self.ranks.wire.buffer(n, self.model_cfg.vocab_size, dtype=self.cfg.torch_dtype)
        group = self.ranks.group
        assert group is not None   # a pipeline of more than one stage has its group
        group.recv([logits], self.pp_size - 1, 0).wait()
        send.wait()
        return out + self._apply(work, logits)

    def _launch(self, work: list[Work]) -> tuple[list[Work], int, Any, torch.Tensor]:
        """Stage 0's part of a micro-batch; the hidden states go on to stage 1 without waiting
        (the tensor is kept until the send is done)."""
        assert self.model is not None and self.pool is not None and self.ranks is not None
        batch, ids = build_batch(work, self.cfg.block_size)
        self.ranks.broadcast("forward", batch, None)
        dev = self.cfg.device
        hidden = self.ranks.wire.out(self.model.forward(batch.to(dev), self.pool, input_ids=ids.to(dev)))
        group = self.ranks.group
        assert group is not None
        send = group.send([hidden], 1, 0)
        return work, sum(1 for s in batch.slices if s.want_logits), send, hidden

    def producer_units(self) -> list[tuple[int, tuple[int, int], int]]:
        """What each stage serves as a KV producer: (stage, layers [start, end), first KV head)."""
        return [(r, part, 0) for r, part in enumerate(self.parts)]

    def stage_of(self, layer: int) -> tuple[int, int]:
        """(stage, local layer index) owning a global layer."""
        for r, (a, b) in enumerate(self.parts):
            if a <= layer < b:
                return r, layer - a
        raise ValueError(f"no stage owns layer {layer}")

    def read_kv(self, layer: int, blocks: list[int]) -> torch.Tensor:
        """KV of a global layer for `blocks`: [n, 2, kv_heads, bs, hd]."""
        stage, local = self.stage_of(layer)
        if stage == 0:
            assert self.pool is not None
            return self.pool.layers[local][torch.tensor(blocks, device=self.pool.layers[local].device)].cpu()
        assert self.ranks is not None
        return self.ranks.request(stage, "read_kv", local, blocks)

    def close(self) -> None:
        ranks = getattr(self, "ranks", None)
        if ranks is not None:
            ranks.close()
            self.ranks = None
