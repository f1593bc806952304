"""One answer's choices as the adapters build them: each choice's tokens, the text it has let out,
what a stop string may still claim (held back), its logprobs, and echo's lead."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.engine.engine import StepOutput
from workers.openai_io import Detokenizer, GenRequest, logprobs_json

if TYPE_CHECKING:
    from workers.server import Outputs


def _per_token(o: StepOutput) -> Any:
    """A step's output as (tokens, logprobs, finished, reason) of one token each (an engine step may
    give several: a fake engine with zero decode time, speculative decoding)."""
    toks = o.new_tokens
    if len(toks) <= 1:
        yield toks, o.logprobs, o.finished, o.finish_reason
        return
    last = len(toks) - 1
    for i, t in enumerate(toks):
        end = i == last
        yield [t], o.logprobs[i:i + 1] if o.logprobs else None, o.finished and end, o.finish_reason if end else None


class Choice:
    """One choice of an answer: its sequence, the text it has let out, what a stop string may
    still claim (held back), its tokens and logprobs."""

    def __init__(self, index: int, seq_id: str, q: "Outputs", first: list[int] | None = None,
                 first_logprobs: list[Any] | None = None) -> None:
        self.index, self.seq_id, self.q = index, seq_id, q
        self.first = list(first or [])
        self.ids: list[int] = list(self.first)
        self.lps: list[Any] = list(first_logprobs or [])
        self.finish: str | None = None
        self.stopped = False           # ended by a stop string (its sequence still runs: abort it)
        self.text = ""                 # let out
        self.pending = ""              # held back: may be the start of a stop string
        self.new_ids: list[int] = list(self.first)
        self.new_lps: list[Any] = list(self.lps)
        self.lead = ""
        self._out = 0                  # text let out so far (chars of `text` taken)
        self._off = 0                  # text offset of the next logprobs entry

    def start(self, tok: Any, gen: GenRequest) -> None:
        self.detok = Detokenizer(tok)
        self.hold = max((len(s) for s in gen.stop), default=1) - 1
        self.stops = gen.stop
        self.lead = gen.prompt_text if gen.echo else ""
        if self.first:
            self._text(self.detok.add(self.first), False)

    def add(self, toks: list[int], lps: list[Any] | None, finished: bool, reason: str | None) -> None:
        self.ids += toks
        self.new_ids += toks
        if lps:
            self.lps += lps
            self.new_lps += lps
        if finished:
            self.finish = reason or "length"
        self._text(self.detok.add(toks, final=finished), finished)

    def _text(self, piece: str, final: bool) -> None:
        buf = self.pending + piece
        if self.stops:
            hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.text += buf[:min(hits)]
                self.pending = ""
                if self.finish is None or self.finish == "length":
                    self.finish, self.stopped = "stop", self.finish is None
                return
        cut = len(buf) if final or not self.stops else max(0, len(buf) - self.hold)
        self.text += buf[:cut]
        self.pending = buf[cut:]
        if final and self.pending:
            self.text += self.pending
            self.pending = ""

    def take(self, tok: Any, gen: GenRequest, final: bool) -> tuple[str, Any, list[int]]:
        """What is new since the last take: text, logprobs object (or None), token ids."""
        text = self.lead + self.text[self._out:] if self.lead else self.text[self._out:]
        self._out = len(self.text)
        lead, self.lead = self.lead, ""
        lps = (logprobs_json(gen.kind, tok, self.new_ids, self.new_lps, self._off)
               if gen.params.logprobs is not None and self.new_ids else None)
        self._off += len(text) - len(lead)
        ids, self.new_ids, self.new_lps = self.new_ids, [], []
        return text, lps, ids

    def whole(self, gen: GenRequest, tok: Any, want_ids: bool) -> dict[str, Any]:
        lps = logprobs_json(gen.kind, tok, self.ids, self.lps) if gen.params.logprobs is not None else None
        return {"index": self.index, "text": self.lead + self.text, "finish": self.finish or "length",
                "logprobs": lps, "token_ids": self.ids if want_ids else None}
