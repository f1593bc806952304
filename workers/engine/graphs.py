"""Decode steps as CUDA graphs (issue 19): on a GPU, a step of B single-token sequences is hundreds
of small kernels whose launch costs the host more than the GPU spends on them. Captured once per
(batch bucket, table width) over fixed device buffers and replayed, a step costs the host one
buffer upload and one replay.

- Buckets: B rounds up to 1, 2, 4, 8, 16, 32, ... (up to the engine's `max_num_seqs`); the block
  table's width (the longest sequence's blocks) to 1, 2, 4, 8, then multiples of 8 (attention
  reads the table's width: little padding, and a new shape only every 8 blocks of context). A graph is captured the
  first time its shape is needed, the largest first sharing one memory pool.
- Inputs: one flat int64 device buffer per shape: ids, sources, positions, slots, context lengths
  [B] and block tables [B, nb], filled from one host tensor per step (the graph reads views of it).
- Outputs: the logits [B, vocab], and each row's greedy token in `tokens`, one device buffer that
  every graph shares. A row whose input token is not known on the host yet (the engine runs one
  step ahead, `Engine.step`) names in `sources` the row of the step before that sampled it: the
  graph takes that row's token from `tokens` before it writes its own, so a greedy decode never
  waits for the host between steps.
- Padding rows of a bucket write their KV into a scratch block past the pool's last block (the
  block manager never hands it out) and attend to it alone.
- Which engines: a whole model on one rank (monolithic, TP 1 decode, PP 1) on CUDA. Elsewhere, and
  on the CPU, the same buffers and the same `LlamaStage.decode` run eagerly (`capture=False`): the
  bookkeeping is tested on the CPU, the capture on the GPU (bench/gpu_check.py).
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from workers.engine.kv_cache import KVPool
from workers.engine.model import LlamaStage
from workers.engine.paged import table_width
from workers.engine.scheduler import Work


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, model: LlamaStage, pool: KVPool, scratch_block: int, max_batch: int, device: str,
                 capture: bool) -> None:
        self.model, self.pool, self.scratch = model, pool, scratch_block
        self.bs = pool.block_size
        self.max_batch = max_batch
        self.device = device
        self.capture = capture
        self.buckets = sorted({min(_pow2(b), max_batch) for b in range(1, max_batch + 1)})
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._mempool: Any = None
        self.replays = 0
        # each row's greedy token of the last step run (rows past the batch: padding's, never read)
        self.tokens = torch.zeros(max(self.buckets), dtype=torch.long, device=device)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences exceed the largest bucket {self.buckets[-1]}")

    def eligible(self, work: list[Work]) -> bool:
        """A pure decode step the graphs can run: every member one token, sampled."""
        return 0 < len(work) <= self.max_batch and all(w.n == 1 and w.want_logits for w in work)

    def _views(self, buf: torch.Tensor, B: int, nb: int) -> tuple[torch.Tensor, ...]:
        ids, src, pos, slots, lens = (buf[i * B:(i + 1) * B] for i in range(5))
        return ids, src, pos, slots, lens, buf[5 * B:].view(B, nb)

    def _fn(self, buf: torch.Tensor, B: int, nb: int, dst: torch.Tensor) -> torch.Tensor:
        """One decode step over `buf`; each row's greedy token into `dst[:B]` (`tokens`, except
        for a warm-up: see `_get`)."""
        ids, src, pos, slots, lens, table = self._views(buf, B, nb)
        ids = torch.where(src >= 0, self.tokens[src.clamp(min=0)], ids)   # tokens the host has not seen yet
        logits = self.model.decode(ids, pos, slots, table, lens, self.pool)
        dst[:B] = logits.argmax(-1)
        return logits

    def _get(self, B: int, nb: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        key = (B, nb)
        got = self._graphs.get(key)
        if got is not None:
            return got
        buf = torch.zeros(5 * B + B * nb, dtype=torch.long, device=self.device)
        buf[B:2 * B] = -1
        buf[3 * B:4 * B] = self.scratch * self.bs          # until filled: every row a padding row
        buf[4 * B:5 * B] = 1
        buf[5 * B:] = self.scratch
        # Warm-up, off the graph (lazy inits, cuBLAS workspaces): twice, its tokens into a scratch
        # buffer. A new shape is met while the engine's step before is in flight, and the rows of
        # the step this shape runs read that step's tokens from `tokens`: a warm-up writing there
        # would feed them padding's argmax. (Eager on the CPU too, so the CPU tests meet the
        # warm-up between two steps as the GPU does.)
        spare = torch.empty_like(self.tokens)
        if not self.capture:
            self._fn(buf, B, nb, spare)
            got = (None, buf, torch.empty(0))
        else:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._fn(buf, B, nb, spare)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            # thread-local: the KV receiver's thread copies into the pool (on its own stream) while
            # a shape is captured here; in the default global mode its CUDA calls would end the capture
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                out = self._fn(buf, B, nb, self.tokens)
            got = (graph, buf, out)
        self._graphs[key] = got
        return got

    def run(self, work: list[Work], sources: list[int] | None = None) -> torch.Tensor:
        """Logits [len(work), vocab] of a decode step (rows in `work`'s order); each row's greedy
        token lands in `tokens[:len(work)]`. `sources`: per row, the row of the step before whose
        greedy token is this row's input (-1: the host's token)."""
        n = len(work)
        B = self.bucket(n)
        nb = table_width(max(len(w.seq.blocks) for w in work))
        bs, scratch = self.bs, self.scratch
        ids, pos, slots, lens = [0] * B, [0] * B, [scratch * bs] * B, [1] * B
        src = [-1] * B
        if sources is not None:
            src[:n] = sources
        table = [scratch] * (B * nb)
        for i, w in enumerate(work):
            p = w.start
            seq = w.seq
            bl = seq.blocks
            k = p - len(seq.prompt)
            ids[i] = seq.prompt[p] if k < 0 else seq.output[k]
            pos[i] = p
            slots[i] = bl[p // bs] * bs + p % bs
            lens[i] = p + 1
            table[i * nb:i * nb + len(bl)] = bl
        graph, buf, out = self._get(B, nb)
        # array -> tensor without a per-element conversion (torch.tensor of a 2,800-int list at batch
        # 64 was ~0.2 ms of host time per step)
        host = torch.frombuffer(array("q", ids + src + pos + slots + lens + table), dtype=torch.long)
        if buf.is_cuda:  # pinned (the caching host allocator keeps it until the copy is done): the copy
            host = host.pin_memory()   # queues behind a step in flight instead of waiting for it
        buf.copy_(host, non_blocking=True)
        self.replays += 1
        if graph is None:
            return self._fn(buf, B, nb, self.tokens)[:n]
        graph.replay()
        return out[:n]
