"""Requests that are several PD requests: a list of prompts, or `n` > 1 (docs/protocol.md section 9).

A prefill hands the KV of one sequence to one decode, and ATOM takes one string prompt, vLLM
returns `kv_transfer_params` for the first prompt of a list only: so for flows with `fanout` the
mesh splits such a request into one PD pair per (prompt, choice), runs them at once, and merges the
answers back into one OpenAI answer: choice `index` = prompt index * n + choice, usage summed
(prompt tokens once per prompt), one id; streamed choices interleave, each chunk with its index.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from contract.errors import InvalidRequest, UpstreamError
from mesh.request import ClientRequest

MAX_PARTS = 128


@dataclass(frozen=True, slots=True)
class Part:
    creq: ClientRequest
    index: int            # the choice's index in the merged answer
    first_of_prompt: bool  # counts the prompt's tokens in the merged usage


def needs_split(creq: ClientRequest) -> bool:
    b = creq.body
    if (b.get("n") or 1) > 1:
        return True
    p = b.get("prompt") if creq.kind == "completions" else None
    return isinstance(p, list) and len(p) > 1 and not isinstance(p[0], int)


def split(creq: ClientRequest) -> list[Part]:
    b = creq.body
    n = b.get("n") or 1
    p = b.get("prompt")
    prompts = p if creq.kind == "completions" and isinstance(p, list) and not isinstance(p[0], int) else [p]
    if len(prompts) * n > MAX_PARTS:
        raise InvalidRequest(f"n: {len(prompts)} prompt(s) x n={n} is more than the {MAX_PARTS} sequences one PD "
                             "request may fan out to", param="n")
    seed = b.get("seed")
    parts = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            body = dict(b)
            body.pop("n", None)
            if creq.kind == "completions":
                body["prompt"] = prompt
            if seed is not None and j:
                body["seed"] = (seed + j) % 2 ** 63   # reproducible, and distinct choices
            if creq.stream:
                body["stream_options"] = {"include_usage": True}   # summed into the merged usage
            sub = ClientRequest(creq.kind, creq.model, creq.stream, True, creq.max_tokens, body,
                                f"{creq.request_id}-{i * n + j}", creq.session_key)
            parts.append(Part(sub, i * n + j, j == 0))
    return parts


def _usage(total: dict[str, int], u: Any, first_of_prompt: bool) -> None:
    if not isinstance(u, dict):
        return
    if first_of_prompt and type(u.get("prompt_tokens")) is int:
        total["prompt_tokens"] += u["prompt_tokens"]
    if type(u.get("completion_tokens")) is int:
        total["completion_tokens"] += u["completion_tokens"]


class Merge:
    """The merged answer of a split request."""

    def __init__(self, creq: ClientRequest) -> None:
        self.creq = creq
        self.id = ("chatcmpl-" if creq.kind == "chat" else "cmpl-") + creq.request_id
        self.created = int(time.time())
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def _total(self) -> dict[str, int]:
        u = dict(self.usage)
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
        return u

    def whole(self, parts: list[Part], answers: list[bytes]) -> bytes:
        choices: list[dict[str, Any]] = []
        head: dict[str, Any] = {}
        for part, raw in zip(parts, answers):
            try:
                d = orjson.loads(raw)
                cs = d["choices"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise UpstreamError("a decode answer of a split request is not an OpenAI answer") from None
            if not head:
                head = {k: d[k] for k in ("object", "model", "system_fingerprint") if k in d}
            for c in cs if isinstance(cs, list) else ():
                if isinstance(c, dict):
                    choices.append({**c, "index": part.index})
            _usage(self.usage, d.get("usage"), part.first_of_prompt)
        choices.sort(key=lambda c: c["index"])
        return orjson.dumps({"id": self.id, **head, "created": self.created, "choices": choices,
                             "usage": self._total()})

    def event(self, part: Part, ev: bytes) -> bytes | None:
        """One SSE event of a part, rewritten for the merged stream (None: keep it back)."""
        if not ev.startswith(b"data: "):
            return ev  # an error event, or a comment: passed on as it is
        payload = ev[6:].strip()
        if payload == b"[DONE]":
            return None
        try:
            d = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return ev
        if not isinstance(d, dict):
            return ev
        cs = d.get("choices")
        if "usage" in d:
            _usage(self.usage, d.pop("usage"), part.first_of_prompt)
        if not cs:
            return None
        d.pop("kv_transfer_params", None)
        d["id"], d["created"] = self.id, self.created
        d["choices"] = [{**c, "index": part.index} if isinstance(c, dict) else c for c in cs]
        return b"data: " + orjson.dumps(d) + b"\n\n"

    def tail(self) -> bytes:
        out = b""
        if self.creq.include_usage:
            obj = "chat.completion.chunk" if self.creq.kind == "chat" else "text_completion"
            out += b"data: " + orjson.dumps({"id": self.id, "object": obj, "created": self.created,
                                             "model": self.creq.model, "choices": [],
                                             "usage": self._total()}) + b"\n\n"
        return out + b"data: [DONE]\n\n"
