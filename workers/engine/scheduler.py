"""Continuous batching with chunked prefill under a per-step token budget.

Each step: every running sequence that has a token to decode gets one; what is left of the
budget goes to prompt chunks, first of running sequences, then of newly admitted ones
(admission needs free blocks for the chunk). When a decode needs a block and none is free,
the most recently admitted other sequence is preempted (its blocks freed; it recomputes later).
A prompt larger than the whole pool is rejected at once with a clear reason.

A sequence is uniform: it needs KV for all its tokens (prompt + output) before it can sample
the next one; `computed` counts the tokens whose KV is in the cache. A PD prefill (`hold`)
stops after its first sampled token and keeps its blocks until `release`; a PD decode starts
with `computed = len(prompt)` on blocks that already hold the prompt's KV.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from workers.engine.kv_cache import BlockManager
from workers.engine.sampling import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"          # PD prefill done: blocks kept for the consumer
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    id: str
    prompt: list[int]
    params: SamplingParams
    hold: bool = False
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    state: SeqState = SeqState.WAITING
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a prompt needs at least one token")
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.output) - self.computed


@dataclass(slots=True)
class Work:
    seq: Sequence
    start: int
    n: int
    want_logits: bool


class Scheduler:
    def __init__(self, blocks: BlockManager, block_size: int, max_num_seqs: int, max_batch_tokens: int) -> None:
        self.blocks, self.bs = blocks, block_size
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}
        self.rejected: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        if -(-len(seq.prompt) // self.bs) > self.blocks.num_blocks:
            seq.state, seq.finish_reason = SeqState.FINISHED, "error"
            seq.error = (f"prompt of {len(seq.prompt)} tokens needs more KV blocks than the pool has "
                         f"({self.blocks.num_blocks} x {self.bs})")
            self.rejected.append(seq)
            return
        if seq.computed:  # PD decode: its blocks are already filled
            seq.state = SeqState.RUNNING
            self.running.append(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.rejected)

    def _grow(self, seq: Sequence, upto: int) -> bool:
        need = -(-upto // self.bs) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.blocks.free:
            return False
        seq.blocks += self.blocks.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        seq.blocks, seq.computed, seq.state = [], 0, SeqState.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self, busy: frozenset[str] = frozenset()) -> list[Work]:
        """The next batch; sequences in `busy` (in flight in a pipeline) are left alone."""
        budget = self.max_batch_tokens
        work: list[Work] = []
        # 1) one token for every decoding sequence
        for seq in list(self.running):
            if seq not in self.running or seq.pending != 1 or budget == 0 or seq.id in busy:
                continue
            while not self._grow(seq, seq.computed + 1):
                victims = [s for s in self.running if s is not seq and s not in {w.seq for w in work}
                           and s.id not in busy]
                if not victims:
                    break
                self._preempt(victims[-1])
            if not self._grow(seq, seq.computed + 1):
                self._preempt(seq)
                continue
            work.append(Work(seq, seq.computed, 1, True))
            budget -= 1
        # 2) prompt chunks of running sequences, 3) then of waiting ones
        for seq in [s for s in self.running if s.pending > 1 and s.id not in busy]:
            if budget == 0:
                break
            n = min(seq.pending, budget)
            if not self._grow(seq, seq.computed + n):
                continue
            work.append(Work(seq, seq.computed, n, seq.computed + n == len(seq.tokens)))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.pending, budget)
            if not self._grow(seq, seq.computed + n):
                break
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            work.append(Work(seq, seq.computed, n, seq.computed + n == len(seq.tokens)))
            budget -= n
        return work

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq.hold and reason != "error":
            seq.state = SeqState.HELD
            self.held[seq.id] = seq
        else:
            seq.state = SeqState.FINISHED
            self.blocks.release(seq.blocks)
            seq.blocks = []

    def release(self, seq_id: str) -> bool:
        seq = self.held.pop(seq_id, None)
        if seq is None:
            return False
        self.blocks.release(seq.blocks)
        seq.blocks, seq.state = [], SeqState.FINISHED
        return True

    def abort(self, seq_id: str) -> bool:
        """Stop a sequence wherever it is (waiting, running, or held after its prefill) and free its
        blocks; False when no such sequence is here (finished, released, or never added)."""
        if self.release(seq_id):
            return True
        for seq in list(self.running) + list(self.waiting):
            if seq.id == seq_id:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                else:
                    self.running.remove(seq)
                seq.state, seq.finish_reason = SeqState.FINISHED, "abort"
                self.blocks.release(seq.blocks)
                seq.blocks = []
                return True
        return False

    def census(self) -> tuple[int, int]:
        """(blocks of running and waiting sequences, blocks of held ones)."""
        live = sum(len(s.blocks) for s in self.running) + sum(len(s.blocks) for s in self.waiting)
        return live, sum(len(s.blocks) for s in self.held.values())
