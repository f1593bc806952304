"""The mock fleet's engine: the real scheduler and block manager, a token model instead of a model.

`FakeEngine` is an `Engine` (the same `add` / `add_from_kv` / `abort` / `release` / `step`, the
same `Scheduler`, `BlockManager`, sequences, holds and stop rules) whose step picks tokens from a
deterministic token model instead of running a forward pass, and says how long the step would
have taken (`step_s`, from a timing model). It runs inline on the adapter's event loop
(`inline = True`): its calls are cheap and never block. The HTTP side is the real adapters'
(`workers.server`, `workers.prefill`, `workers.decode`): every test of the mock fleet exercises
the code the real workers run.

Tokens: the first from a hash of the prompt's ids (and the seed, where one is given), each next
from the previous, so a PD answer equals the same fleet's monolithic answer. Text: token t reads
" t<t>"; a prompt's text is one token per UTF-8 byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
from array import array
from dataclasses import dataclass
from typing import Any, Callable

from contract.protocol import ConsumerRank, WriteRequest
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, StepOutput
from workers.engine.kv_cache import BlockManager
from workers.engine.sampling import Logprob, SamplingParams
from workers.engine.scheduler import Scheduler, SeqState, Sequence
from workers.faults import Faults
from workers.kv.stage import Unit

VOCAB = 50000


@dataclass(frozen=True, slots=True)
class MockTiming:
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    jitter: float = 0.0            # +- fraction applied to every delay
    kv_ms_per_block: float = 0.0   # side-channel write time per block

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0")


def token_text(tok: int) -> str:
    return f" t{tok}"


def first_token(prompt: list[int] | str, seed: int | None = None) -> int:
    """The first token for a prompt's ids (a string: its UTF-8 bytes, as `FakeTokenizer` encodes it)
    and seed: a hash of the last 4,096 ids."""
    if isinstance(prompt, str):
        prompt = list(prompt.encode("utf-8"))
    h = hashlib.blake2b(array("q", prompt[-4096:]).tobytes(), digest_size=8,
                        salt=b"" if seed is None else seed.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little") % VOCAB


def next_token(prev: int) -> int:
    return (prev * 48271 + 11) % VOCAB


def token_ids(first: int, n: int) -> list[int]:
    out = [first]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out[:n]


def fake_logprob(t: int, k: int) -> Logprob:
    """A deterministic log-probability for token t and k alternatives (t itself the most likely)."""
    lp = -((t % 997) + 1) / 1000.0
    return lp, tuple((t if i == 0 else (t + i) % VOCAB, lp - 0.5 * i) for i in range(k))


class FakeTokenizer:
    """One token per UTF-8 byte of a prompt; token t's text is " t<t>" (a piece of its own)."""
    eos_id: int | None = None
    encode_below = 256
    pieces = True      # decode(ids) == "".join(decode([i]) for i in ids): text per token, no state

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return f" t{ids[0]}" if len(ids) == 1 else "".join([f" t{i}" for i in ids])


@dataclass(frozen=True, slots=True)
class FakeModelConfig:
    vocab_size: int = VOCAB
    max_position_embeddings: int = 2 ** 62
    eos_token_id: int | None = None
    bos_token_id: int | None = None


class FakeEngine(Engine):
    """An `Engine` without a model: see the module docstring."""

    inline = True

    def __init__(self, *, num_blocks: int = 4096, block_size: int = 16, timing: MockTiming = MockTiming(),
                 rng: random.Random | None = None, max_num_seqs: int = 4096, max_batch_tokens: int = 1 << 30) -> None:
        # no Engine.__init__: there is no checkpoint to read and no model or KV pool to build
        self.cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                max_batch_tokens=max_batch_tokens)
        # (type: ignore below) a model config with the fields the adapters read, and no checkpoint
        self.model_cfg = FakeModelConfig()  # type: ignore[assignment]
        self.tokenizer = FakeTokenizer()
        self.model = None
        self.pool = None
        self.blocks = BlockManager(num_blocks)
        self.scheduler = Scheduler(self.blocks, block_size, max_num_seqs, max_batch_tokens)
        self.seqs: dict[str, Sequence] = {}
        self.captured = None
        self.timing = timing
        self.rng = rng or random.Random()
        self.step_s = 0.0     # how long the last step would have taken on a real engine
        # zero prefill and decode time: the adapter may run the steps at once, in the caller's turn
        self.instant = timing.prefill_ms_per_token == 0 and timing.decode_ms_per_token == 0

    def delay(self, ms: float) -> float:
        if ms <= 0:
            return 0.0
        j = self.timing.jitter
        return ms / 1000.0 * (1 + self.rng.uniform(-j, j) if j else 1)

    def _replay_first_draw(self, seq: Sequence) -> None:
        pass   # the token model draws nothing

    def step(self) -> list[StepOutput]:
        """One continuous-batching step: the scheduler's batch, each sequence's next token from the
        token model. A step takes as long as its longest member (prefill ms per prompt token of its
        chunk, decode ms per token), as members of one batch run side by side."""
        out = self._rejections()
        work = self.scheduler.schedule()
        longest = 0.0
        pre, dec = self.timing.prefill_ms_per_token, self.timing.decode_ms_per_token
        for w in work:
            seq = w.seq
            if seq.state == SeqState.FINISHED:
                continue
            prompt_part = max(0, min(w.start + w.n, len(seq.prompt)) - w.start)
            longest = max(longest, pre * prompt_part if prompt_part else dec)
            seq.computed = w.start + w.n
            if not w.want_logits:
                continue
            t = next_token(seq.output[-1]) if seq.output else first_token(seq.prompt, seq.params.seed)
            k = seq.params.logprobs
            o = self._emit(seq, t, None if k is None else [fake_logprob(t, k)])
            if not dec and seq.state == SeqState.RUNNING:
                self._burst(seq, o)
            out.append(o)
        self.step_s = self.delay(longest)
        return out

    def _burst(self, seq: Sequence, o: StepOutput) -> None:
        """Zero decode time: the rest of a running sequence in this step, into its output `o`. Its
        blocks are allocated for every token's KV first (the pool and the census stay true); where
        the pool has no room for all of them, one token per step as usual."""
        p = seq.params
        room = p.max_tokens - len(seq.output)
        n_prompt = len(seq.prompt)
        if room <= 0 or not self.scheduler._grow(seq, n_prompt + len(seq.output) + room - 1):
            return
        toks, lps, k, stops = o.new_tokens, o.logprobs, p.logprobs, p.stop_token_ids
        t, reason = toks[-1], "length"
        for _ in range(room):
            t = next_token(t)
            seq.output.append(t)
            toks.append(t)
            if lps is not None and k is not None:
                lps.append(fake_logprob(t, k))
            if t in stops:
                reason = "stop"
                break
        seq.computed = n_prompt + len(seq.output) - 1
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.id, None)
        o.finished, o.finish_reason = True, reason

    def held_sequence(self, seq_id: str, n_blocks: int) -> tuple[int, ...]:
        """A sequence held as after its prefill, on `n_blocks` new blocks (tests: an orphan transfer)."""
        seq = Sequence(seq_id, [1] * (n_blocks * self.cfg.block_size), SamplingParams(max_tokens=1), hold=True)
        seq.blocks = self.blocks.allocate(n_blocks)
        seq.computed, seq.state = len(seq.prompt), SeqState.HELD
        self.seqs[seq_id] = seq
        self.scheduler.held[seq_id] = seq
        return tuple(seq.blocks)

    def close(self) -> None:
        pass


# -- the fake engine's KV side (what the adapters' side channels serve and pull) -------------

class FakeProducerKV:
    """A prefill pipeline of `pp_size` stages, all served from this process: each stage's writer
    moves nothing and takes the timing model's time per block (plus a slow stage's fault)."""
    backend: str | None = None
    tp_size = 1

    def __init__(self, pp_size: int, num_layers: int, timing: MockTiming, delay: Callable[[float], float]) -> None:
        if pp_size < 1:
            raise ValueError("pp_size must be >= 1")
        self.pp_size, self.num_layers, self.timing, self.delay = pp_size, num_layers, timing, delay
        self.faults: Callable[[], Faults] = Faults   # the adapter's current faults (set by the fleet)

    def layers_of(self, rank: int) -> tuple[int, int]:
        per, rem = divmod(self.num_layers, self.pp_size)
        start = rank * per + min(rank, rem)
        return start, start + per + (1 if rank < rem else 0)

    def units(self) -> list[Unit]:
        return [(r, self.layers_of(r), 0) for r in range(self.pp_size)]

    def local_writers(self) -> dict[int, Any]:
        return {r: self._writer(r) for r in range(self.pp_size)}

    def _writer(self, rank: int) -> Any:
        async def write(req: WriteRequest, consumer: ConsumerRank) -> None:
            ms = self.timing.kv_ms_per_block * len(req.src_block_ids)
            f = self.faults()
            if rank == f.slow_stage:
                ms += f.slow_stage_ms
            if ms:
                await asyncio.sleep(self.delay(ms))
        return write

    def remote_port(self, rank: int) -> int:
        raise LookupError("every stage of a mock pipeline is served in its process")

    def grant(self, transfer_id: str, blocks: tuple[int, ...]) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class FakeConsumerKV:
    """A decode engine of `tp_size` ranks, its KV heads split across them; nothing is registered."""

    def __init__(self, worker_id: str, tp_size: int, num_kv_heads: int = 8) -> None:
        if tp_size < 1 or num_kv_heads % tp_size:
            raise ValueError("tp_size must be >= 1 and divide num_kv_heads")
        per = num_kv_heads // tp_size
        self.tp_size = tp_size
        self._ranks = tuple(ConsumerRank(tp_rank=r, segment=f"{worker_id}/rank{r}", head_start=r * per,
                                         head_end=(r + 1) * per) for r in range(tp_size))

    def ranks(self) -> tuple[ConsumerRank, ...]:
        return self._ranks

    def pull_extra(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
