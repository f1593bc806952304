"""PP stage engine: `pp_size` stage processes, each building only its layers.

Stage 0 (this process) owns the scheduler and the block table; every stage's pool is indexed
by the same block ids. Per step stage 0 sends the batch metadata to every stage (ZMQ), runs
its layers and sends the hidden states to stage 1 (gloo); each stage passes them on; the last
stage sends the logits of the sampled rows back to stage 0, which samples.
One micro-batch is in flight at a time (see the closing note of the engine issue).
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.engine.config import EngineConfig, ModelConfig, Parallel, partition
from workers.engine.dist import Ranks
from workers.engine.engine import Engine
from workers.engine.model import ForwardBatch


class PPEngine(Engine):
    def __init__(self, checkpoint: str | Path, cfg: EngineConfig, pp_size: int,
                 layer_partition: str | None = None) -> None:
        mc = ModelConfig.load(checkpoint)
        self.parts = partition(mc.num_hidden_layers, pp_size, layer_partition)
        pars = [Parallel(pp_rank=r, pp_size=pp_size, layer_start=a, layer_end=b)
                for r, (a, b) in enumerate(self.parts)]
        self.pp_size = pp_size
        self.ranks = Ranks("pp", checkpoint, cfg, pars) if pp_size > 1 else None
        try:
            super().__init__(checkpoint, cfg, pars[0])
        except BaseException:
            self.close()
            raise

    def _local_forward(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model is not None and self.pool is not None
        if self.ranks is None:
            return super()._local_forward(batch, input_ids)
        self.ranks.broadcast("forward", batch, None)
        hidden = self.model.forward(batch, self.pool, input_ids=input_ids).contiguous()
        g = self.ranks.group
        g.send([hidden], 1, 0).wait()
        n = sum(1 for s in batch.slices if s.want_logits)
        logits = torch.empty(n, self.model_cfg.vocab_size, dtype=hidden.dtype)
        g.recv([logits], self.pp_size - 1, 0).wait()
        return logits

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
            return self.pool.layers[local][torch.tensor(blocks)].clone()
        assert self.ranks is not None
        return self.ranks.request(stage, "read_kv", local, blocks)

    def close(self) -> None:
        if getattr(self, "ranks", None) is not None:
            self.ranks.close()  # type: ignore[union-attr]
            self.ranks = None
