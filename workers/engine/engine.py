"""The engine: scheduler + model + paged KV, one synchronous `step()` at a time.

`Engine` runs a whole model in this process (monolithic, or TP rank 0 / PP stage 0 when given
a distributed `forward`). The PD hooks: `add(..., hold=True)` stops after the first token and
keeps the blocks until `release`; `add_from_kv` continues from KV already in given blocks plus
the prefill's first token.

One step ahead (issue 19): where decode steps run as CUDA graphs and every running sequence is a
greedy decode, `step()` launches the next step before it waits for the last one. The next step's
input tokens are the last step's greedy tokens, taken on the device (`DecodeGraphs.tokens`); the
host learns them while the GPU runs the next step, so the GPU never waits for the host's
scheduling, sampling bookkeeping and the caller's handling of the outputs. A step's outputs come
back from the `step()` call after the one that launched it. A sequence that stops (EOS, a stop
token) has one more row in the step already launched: that row is dropped, and its blocks go back
to the pool only once that step is done (nothing else may reuse them while the GPU still writes
there). Anything else (a prompt to prefill, sampling, logprobs, a preemption) waits for the step
in flight and runs as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from workers.engine import paged
from workers.engine import tokenizer as tok
from workers.engine.checkpoint import load_weights
from workers.engine.config import EngineConfig, ModelConfig, Parallel
from workers.engine.graphs import DecodeGraphs
from workers.engine.kv_cache import BlockManager, KVPool
from workers.engine.model import ForwardBatch, LlamaStage, SeqSlice
from workers.engine.sampling import Logprob, SamplingParams, logprob_of, sample
from workers.engine.scheduler import Scheduler, SeqState, Sequence, Work

log = logging.getLogger(__name__)

Forward = Callable[[ForwardBatch, torch.Tensor], torch.Tensor]  # (batch, input_ids) -> logits


@dataclass(slots=True)
class StepOutput:
    seq_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[Logprob] | None = None   # one per new token, where the sequence asked for them


@dataclass(slots=True)
class _Ahead:
    """A greedy decode step launched and not yet seen by the host."""
    work: list[Work]
    index: list[int]           # per row: the output index its token fills (a placeholder until then)
    rows: dict[int, int]       # id(sequence) -> row
    last: frozenset[str]       # sequences whose token of this step is their last by length
    host: torch.Tensor         # the rows' tokens, copied here from the device
    event: Any                 # done when `host` holds them (None on the CPU: at once)
    fenced: list[int] = field(default_factory=list)  # blocks freed by the host while this step may write them


PLACEHOLDER = -1   # an output token the GPU has sampled and the host has not seen yet


def build_batch(work: list[Work], block_size: int) -> tuple[ForwardBatch, torch.Tensor]:
    """A step's batch on the host (it may go to other ranks first; `ForwardBatch.to` moves it)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    slices = []
    for w in work:
        toks = w.seq.tokens[w.start:w.start + w.n]
        ids += toks
        rng = range(w.start, w.start + w.n)
        pos += rng
        bl = w.seq.blocks
        slots += [bl[p // block_size] * block_size + p % block_size for p in rng]
        slices.append(SeqSlice(w.start, w.n, torch.tensor(bl, dtype=torch.long), w.want_logits))
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return ForwardBatch(slices, as_t(pos), as_t(slots)), as_t(ids)


class Engine:
    # an engine whose calls are cheap and never block runs them on the adapter's event loop (the
    # mock fleet's fake engine); `step_s` is then how long its last step would have taken, and
    # `instant` says every step takes no time
    inline: bool = False
    instant: bool = False
    step_s: float = 0.0
    ahead: bool = False            # greedy decode steps run one ahead (set where decode graphs exist)
    _ahead: _Ahead | None = None   # the step in flight

    @property
    def fenced(self) -> int:
        """Blocks of finished sequences kept until the step in flight is done (taken, in no sequence)."""
        return len(self._ahead.fenced) if self._ahead is not None else 0

    def close(self) -> None:
        """Stop what the engine started (rank processes, transports); a single-process engine has none."""

    def __init__(self, checkpoint: str | Path, cfg: EngineConfig = EngineConfig(), par: Parallel = Parallel(),
                 forward: Forward | None = None, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 build_model: bool = True) -> None:
        self.cfg, self.par = cfg, par
        self.model_cfg = ModelConfig.load(checkpoint)
        mc = self.model_cfg
        self.tokenizer = tok.load(checkpoint, mc.bos_token_id, mc.eos_token_id)
        self.model: LlamaStage | None = None
        self.pool: KVPool | None = None
        self.graphs: DecodeGraphs | None = None
        # decode steps as CUDA graphs: a whole model on this rank, its forward local
        graphs = build_model and forward is None and all_reduce is None and par.first and par.last \
            and par.tp_size == 1 and (cfg.graphs == "eager" or (cfg.graphs == "auto" and cfg.on_gpu))
        if build_model:
            weights = load_weights(checkpoint, mc, par, cfg.torch_dtype, cfg.device)
            self.model = LlamaStage(mc, par, weights, all_reduce)
            # with graphs, one scratch block past the last (padding rows write there; never handed out)
            self.pool = KVPool(len(self.model.layer_ids), cfg.num_blocks + int(graphs), self.model.kv_heads,
                               cfg.block_size, mc.head_dim, cfg.torch_dtype, cfg.device)
            if graphs:
                self.graphs = DecodeGraphs(self.model, self.pool, cfg.num_blocks, cfg.max_num_seqs, cfg.device,
                                           capture=cfg.graphs == "auto")
        # the decode attention's compiled variants, all at start on a GPU (never while serving: Triton
        # compiles a variant on first use, ~1 s, which would stall every sequence of the engine)
        self.kernel_variants, self.warm_s = 0, 0.0
        if self.model is not None and self.pool is not None and cfg.on_gpu and paged.available(cfg.device):
            t0 = time.perf_counter()
            self.kernel_variants = paged.compile_variants(
                self.pool.layers[0], self.model.heads, list(range(1, cfg.max_num_seqs + 1)),
                min(cfg.num_blocks, -(-mc.max_position_embeddings // cfg.block_size)), self.model.scale,
                self.pool.layers[0].shape[0] - 1)   # the warm-up reads that block, writes nothing to the pool
            self.warm_s = time.perf_counter() - t0
            log.info("decode attention: %d kernel variants compiled in %.1f s", self.kernel_variants, self.warm_s)
        self.blocks = BlockManager(cfg.num_blocks)
        self.scheduler = Scheduler(self.blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_batch_tokens)
        self._forward = forward or self._local_forward
        self.seqs: dict[str, Sequence] = {}
        self.captured: dict[str, torch.Tensor] | None = None  # set to a dict: logits of each first sample
        self.ahead = self.graphs is not None
        self.ahead_steps = 0   # steps launched ahead of the host
        self._flip = 0
        self._landing: list[torch.Tensor] = []
        if self.graphs is not None:
            pin = cfg.on_gpu
            self._landing = [torch.zeros(cfg.max_num_seqs, dtype=torch.long, pin_memory=pin) for _ in range(2)]

    def _local_forward(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model is not None and self.pool is not None
        dev = self.cfg.device
        return self.model.forward(batch.to(dev), self.pool, input_ids=input_ids.to(dev))

    # -- requests -------------------------------------------------------------------------

    def add(self, seq_id: str, prompt: list[int], params: SamplingParams = SamplingParams(),
            hold: bool = False, checked: bool = False) -> Sequence:
        """`checked`: the caller range-checked `prompt` already (`workers.openai_io.parse`, the one
        check a served request gets; a min and a max over a 220k-token prompt cost ~6 ms here)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} exists")
        vocab = self.model_cfg.vocab_size
        if not checked and prompt and (min(prompt) < 0 or max(prompt) >= vocab):
            bad = [t for t in prompt if not 0 <= t < vocab]
            raise ValueError(f"token ids out of the vocabulary: {bad[:5]}")
        seq = Sequence(seq_id, list(prompt), params, hold=hold)
        self.seqs[seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_from_kv(self, seq_id: str, prompt: list[int], first_token: int, block_ids: list[int],
                    params: SamplingParams = SamplingParams(), allocated: bool = False) -> Sequence:
        """Continue a sequence whose prompt KV already sits in `block_ids` (PD decode); `allocated`:
        the caller allocated those blocks already (to receive the KV into them)."""
        need = -(-len(prompt) // self.cfg.block_size)
        if len(block_ids) != need or seq_id in self.seqs:
            if allocated:
                self.blocks.release(list(block_ids))
            raise ValueError(f"sequence {seq_id} exists" if seq_id in self.seqs else
                             f"{len(prompt)} prompt tokens need {need} blocks, got {len(block_ids)}")
        if not allocated:
            self.blocks.take(list(block_ids))
        try:
            seq = Sequence(seq_id, list(prompt), params, output=[first_token], blocks=list(block_ids),
                           computed=len(prompt))
        except BaseException:  # the blocks are the engine's from the call on: not kept by a failed add
            self.blocks.release(list(block_ids))
            raise
        self._replay_first_draw(seq)
        self.seqs[seq_id] = seq
        if self._stops(seq, first_token):
            self.scheduler.finish(seq, seq.finish_reason or "length")
        else:
            self.scheduler.add(seq)
        return seq

    def _replay_first_draw(self, seq: Sequence) -> None:
        """The prefill drew the first token from the same seed: replay that draw (a multinomial over
        the vocabulary uses the same randoms whatever the probabilities), so a seeded PD answer is
        the engine alone's."""
        if seq.generator is not None and seq.params.temperature > 0:
            torch.multinomial(torch.ones(self.model_cfg.vocab_size), 1, generator=seq.generator)

    def release(self, seq_id: str) -> bool:
        self.seqs.pop(seq_id, None)
        return self.scheduler.release(seq_id)

    def abort(self, seq_id: str) -> bool:
        """Stop a sequence wherever it is and free its blocks (safe for an unknown or finished id)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._fence(seq)
        done = self.scheduler.abort(seq_id)
        self._settle()
        return done

    def _settle(self) -> None:
        """A step in flight with no sequence left running (each stopped or aborted while it ran):
        waited for here, as no caller steps an engine without work (its rows are all dropped)."""
        a = self._ahead
        if a is not None and not self.scheduler.running:
            self._ahead = None
            self._land_ahead(a, None)

    def _fence(self, seq: Sequence) -> None:
        """A sequence in the step in flight leaves: its blocks stay taken until that step is done."""
        a = self._ahead
        if a is not None and id(seq) in a.rows and seq.blocks:
            self.blocks.retain(seq.blocks)
            a.fenced += seq.blocks

    # -- the loop -------------------------------------------------------------------------

    def _stops(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        if not p.ignore_eos and token == self.model_cfg.eos_token_id or token in p.stop_token_ids:
            seq.finish_reason = "stop"
            return True
        if len(seq.output) >= p.max_tokens or (seq.hold and len(seq.output) >= 1):
            seq.finish_reason = "hold" if seq.hold else "length"
            return True
        return False

    def step(self) -> list[StepOutput]:
        out = self._rejections()
        a = self._ahead
        if a is not None:   # a step in flight: launch the next one first where it can go ahead too
            self._ahead = None
            nxt = self._launch_ahead(self.scheduler.schedule(a.last), a) if self._can_go_ahead(a) else None
            self._ahead = nxt
            out += self._land_ahead(a, nxt)
            if nxt is not None:
                self._settle()
                return out
        work = self.scheduler.schedule()
        if not work:
            return out
        if self.graphs is not None and self.graphs.eligible(work):
            if self.ahead and self._greedy(work):
                self._ahead = self._launch_ahead(work, None)
                return out
            return out + self._apply(work, self.graphs.run(work))
        batch, ids = build_batch(work, self.cfg.block_size)
        return out + self._apply(work, self._forward(batch, ids))

    # -- one step ahead ----------------------------------------------------------------------

    @staticmethod
    def _argmax_only(s: Sequence) -> bool:
        """The sequence's next token is the argmax, with nothing else asked of its logits."""
        p = s.params
        return p.temperature == 0 and p.logprobs is None and len(s.output) >= p.min_tokens

    def _greedy(self, work: list[Work]) -> bool:
        """Every row can run ahead: argmax only, and no held prefill (it stops at its first token)."""
        return self.captured is None and all(self._argmax_only(w.seq) and not w.seq.hold for w in work)

    def _can_go_ahead(self, a: _Ahead) -> bool:
        """Would the next schedule be greedy decode rows only, with no preemption (a sequence whose
        last token is still on the device cannot be recomputed)?"""
        g = self.graphs
        sch = self.scheduler
        if g is None or not self.ahead or sch.waiting or sch.rejected or self.captured is not None:
            return False
        need, rows = 0, 0
        bs = self.cfg.block_size
        for s in sch.running:
            pend = s.pending
            if pend > 1:
                return False
            if pend == 0 or s.id in a.last:
                continue
            if not self._argmax_only(s) or s.hold:
                return False
            rows += 1
            need += -(-(s.computed + 1) // bs) > len(s.blocks)
        return 0 < rows <= g.max_batch and need <= self.blocks.free

    def _launch_ahead(self, work: list[Work], prev: _Ahead | None) -> _Ahead | None:
        """Launch a greedy decode step; its tokens become placeholders in the sequences' outputs."""
        if not work:
            return None
        g = self.graphs
        assert g is not None
        rows: dict[int, int] = {}
        index: list[int] = []
        last: list[str] = []
        src = None
        prows = prev.rows if prev is not None else None
        if prows:
            src = [prows.get(id(w.seq), -1) if w.seq.output and w.seq.output[-1] == PLACEHOLDER else -1
                   for w in work]
        for i, w in enumerate(work):
            s = w.seq
            rows[id(s)] = i
            j = len(s.output)
            index.append(j)
            if j + 1 >= s.params.max_tokens:
                last.append(s.id)
        g.run(work, src)
        self.ahead_steps += 1
        for w in work:
            w.seq.output.append(PLACEHOLDER)
            w.seq.computed = w.start + 1
        host = self._landing[self._flip]
        self._flip ^= 1
        n = len(work)
        host[:n].copy_(g.tokens[:n], non_blocking=True)
        event = None
        if host.is_pinned():
            event = torch.cuda.Event()
            event.record()
        return _Ahead(work, index, rows, frozenset(last), host, event)

    def _land_ahead(self, a: _Ahead, nxt: _Ahead | None) -> list[StepOutput]:
        """The host takes in a launched step's tokens: outputs, stops, and the blocks it fenced."""
        if a.event is not None:
            a.event.synchronize()
        if a.fenced:
            self.blocks.release(a.fenced)
        toks = a.host[:len(a.work)].tolist()
        eos = self.model_cfg.eos_token_id
        out: list[StepOutput] = []
        for w, t, j in zip(a.work, toks, a.index):
            s = w.seq
            if s.state == SeqState.FINISHED:   # aborted while in flight
                continue
            s.output[j] = t
            p = s.params
            if not p.ignore_eos and t == eos or t in p.stop_token_ids:
                reason = "stop"
            elif j + 1 >= p.max_tokens:
                reason = "length"
            else:
                out.append(StepOutput(s.id, [t], False))
                continue
            if len(s.output) > j + 1:        # a row in the next step: dropped there, its blocks fenced
                del s.output[j + 1:]
                s.computed = w.start + 1
                if nxt is not None:
                    self._fence(s)
            self.scheduler.finish(s, reason)
            self.seqs.pop(s.id, None)        # finished (a held prefill never runs ahead)
            out.append(StepOutput(s.id, [t], True, reason))
        return out

    def _rejections(self) -> list[StepOutput]:
        out = []
        for seq in self.scheduler.rejected:
            out.append(StepOutput(seq.id, [], True, "error", seq.error))
            self.seqs.pop(seq.id, None)
        self.scheduler.rejected.clear()
        return out

    def _apply(self, work: list[Work], logits: torch.Tensor) -> list[StepOutput]:
        """Advance the sequences of a finished forward and sample where it was asked for."""
        out: list[StepOutput] = []
        row = 0
        greedy: list[int] | None = None
        if logits.device.type != "cpu":  # one transfer per step, not one sync per row
            rows = [w.seq for w in work if w.want_logits]
            if self.captured is None and all(self._argmax_only(s) for s in rows):
                greedy = logits.argmax(-1).tolist()
            else:
                logits = logits.float().cpu()
        for w in work:
            if w.seq.state == SeqState.FINISHED:  # aborted while its micro-batch was in flight
                row += w.want_logits
                continue
            w.seq.computed = w.start + w.n
            if not w.want_logits:
                continue
            seq = w.seq
            if greedy is not None:   # the batch's greedy tokens, taken on the device: no row views
                t = greedy[row]
            else:
                if self.captured is not None and not seq.output:
                    self.captured[seq.id] = logits[row].clone()
                x = logits[row]
                if len(seq.output) < seq.params.min_tokens:  # as vLLM's min_tokens: the stop tokens are masked
                    x = x.clone()
                    x[[self.model_cfg.eos_token_id, *seq.params.stop_token_ids]] = float("-inf")
                t = sample(x, seq.params, seq.generator)
            k = seq.params.logprobs
            lps = None if k is None else [logprob_of(logits[row], t, k)]
            row += 1
            out.append(self._emit(seq, t, lps))
        return out

    def _emit(self, seq: Sequence, t: int, lps: list[Logprob] | None) -> StepOutput:
        """A sampled token into its sequence: the sequence finishes (or is held) where it stops."""
        seq.output.append(t)
        done = self._stops(seq, t)
        if done:
            self.scheduler.finish(seq, seq.finish_reason or "length")
            if seq.state == SeqState.FINISHED:
                self.seqs.pop(seq.id, None)
        return StepOutput(seq.id, [t], done, seq.finish_reason if done else None, logprobs=lps)

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[list[int]]:
        """Run prompts to completion (a convenience for tests and benchmarks)."""
        ids = [f"gen-{i}" for i in range(len(prompts))]
        res: dict[str, list[int]] = {i: [] for i in ids}
        for i, p in zip(ids, prompts):
            self.add(i, p, params)
        while self.scheduler.has_work():
            for o in self.step():
                if o.error:
                    raise RuntimeError(o.error)
                res[o.seq_id] += o.new_tokens
        return [res[i] for i in ids]
