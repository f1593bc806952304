"""Sampling: greedy, temperature, top_k, top_p, per-request seed; stop rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None     # None: none; k >= 0: each sampled token's logprob and the top k
    min_tokens: int = 0             # EOS and stop_token_ids are not sampled before this many tokens

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in 0..20")


Logprob = tuple[float, tuple[tuple[int, float], ...]]   # (the token's logprob, top k (id, logprob))


def logprob_of(logits: torch.Tensor, token: int, k: int) -> Logprob:
    """The model's log-probability of `token` (before temperature, top_k and top_p, as vLLM's
    default raw logprobs) and the k most likely tokens."""
    lp = torch.log_softmax(logits.float(), -1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        v, i = torch.topk(lp, k)
        top = tuple(zip(i.tolist(), v.tolist()))
    return float(lp[token]), top


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits [vocab]."""
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        cut = torch.cumsum(probs, -1) - probs > params.top_p  # keep the smallest set reaching top_p
        sorted_x = sorted_x.masked_fill(cut, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
